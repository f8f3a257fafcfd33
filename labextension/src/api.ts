/**
 * The gpushare REST API (`/gpushare/api/`, see DEVELOPING.md) as typed calls.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { IShare } from './share';

export interface IGpuType {
  type: string;
  count: number;
  memory: number;
  most_free_request: number;
  most_free_memory: number;
  simulated?: boolean;
}

export interface IGpu {
  uuid: string;
  index: number;
  name: string;
  type: string;
  memory: number;
  free_request: number;
  free_memory: number;
  allocations: string[];
  simulated?: boolean;
}

export interface IInventory {
  simulated: boolean;
  gpus: IGpu[];
  types: IGpuType[];
  message?: string;
}

export interface IPreset extends Partial<IShare> {
  name: string;
}

export interface IPresets {
  default: Partial<IShare>;
  presets: IPreset[];
  simulated?: boolean;
}

export interface IAllocation {
  id: string;
  node: string;
  gpus: string[];
  gpu_request: number;
  gpu_limit: number;
  /** The memory cap in bytes per GPU (resolved). */
  gpu_memory: number;
  gpu_type: string | null;
  gpu_count: number;
  kernel_id: string | null;
  state: string;
  extra?: Record<string, unknown>;
  [key: string]: unknown;
}

/** A refusal from the server: 400 invalid_share, 409 no_fit, or anything else it explains. */
export class GpushareRefusal extends Error {
  constructor(
    readonly status: number,
    readonly body: {
      error?: string;
      message?: string;
      field?: string;
      value?: unknown;
      allowed?: string;
      suggestions?: string[];
    }
  ) {
    super(body.message || `gpushare request failed (${status})`);
  }
}

/** Live use of one allocation, from the node daemon (`GET /gpushare/api/usage`). */
export interface IUsage {
  id: string;
  kernel_id: string | null;
  achieved_share: number | null;
  memory_used: number | null;
  memory_cap: number | null;
}

export interface IUsageReport {
  daemon: boolean;
  message?: string;
  allocations: IUsage[];
}

export class GpushareAPI {
  constructor(readonly settings: ServerConnection.ISettings) {}

  private async request<T>(path: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this.settings.baseUrl, 'gpushare', 'api', path);
    const response = await ServerConnection.makeRequest(url, init, this.settings);
    const text = await response.text();
    const body = text ? JSON.parse(text) : {};
    if (!response.ok) {
      throw new GpushareRefusal(response.status, body);
    }
    return body as T;
  }

  gpus(): Promise<IInventory> {
    return this.request<IInventory>('gpus');
  }

  presets(): Promise<IPresets> {
    return this.request<IPresets>('presets');
  }

  async allocations(): Promise<IAllocation[]> {
    const body = await this.request<{ allocations: IAllocation[] }>('allocations');
    return body.allocations;
  }

  usage(): Promise<IUsageReport> {
    return this.request<IUsageReport>('usage');
  }

  release(allocationId: string): Promise<unknown> {
    return this.request(`allocations/${encodeURIComponent(allocationId)}`, {
      method: 'DELETE'
    });
  }

  /** Start a kernel holding `share`; resolves with the kernel model and its allocation. */
  startKernel(
    name: string,
    path: string | undefined,
    share: IShare
  ): Promise<{ id: string; name: string; allocation: IAllocation | null }> {
    const wire: Record<string, unknown> = {
      gpu_request: share.gpu_request,
      gpu_limit: share.gpu_limit
    };
    if (share.gpu_memory !== null) {
      wire.gpu_memory = share.gpu_memory;
    }
    wire.gpu_type = share.gpu_type ?? 'any';
    return this.request('kernels', {
      method: 'POST',
      body: JSON.stringify({ name, path, share: wire })
    });
  }
}
