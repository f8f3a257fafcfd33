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

/** One share on a GPU as the viewer may see it (`GET /gpushare/api/dashboard`). */
export interface IDashboardShare {
  mine: boolean;
  request: number;
  limit: number;
  memory_cap: number;
  gpu_count: number;
  state: string;
  /** The rest only where the viewer may see whose it is. */
  id?: string;
  user?: string | null;
  owner?: string;
  kernel_id?: string | null;
  node?: string;
  path?: string | null;
  command?: string | null;
  pool?: string | null;
  achieved_share?: number | null;
  memory_used?: number | null;
  idle_s?: number | null;
  metered?: boolean;
}

export interface IDashboardGpu {
  uuid: string;
  index: number;
  node: string;
  name: string;
  type: string;
  memory: number;
  healthy: boolean;
  simulated: boolean;
  reserved_request: number;
  reserved_memory: number;
  free_request: number;
  free_memory: number;
  achieved_share: number | null;
  memory_used: number | null;
  shares: IDashboardShare[];
}

export interface IDashboard {
  time: number;
  admin: boolean;
  simulated: boolean;
  source: string;
  metered: boolean;
  message?: string;
  gpus: IDashboardGpu[];
  /** The last two minutes as the server sampled them: [time, achieved share] per GPU (the
   * shares this viewer sees, summed) and per share this viewer sees whole. */
  history?: {
    window_s: number;
    gpus: Record<string, [number, number][]>;
    shares: Record<string, [number, number][]>;
  };
}

/** A kernel start of this server and how far it has got (`GET /gpushare/api/starts`). */
export interface IStart {
  kernel_id: string;
  kernel_name: string;
  path: string | null;
  phase: string;
  message: string;
  since: number;
  updated: number;
  ended: boolean;
  /** The phases seen so far, in order, with the words reported for each. */
  steps?: { phase: string; message: string; at: number }[];
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

  dashboard(): Promise<IDashboard> {
    return this.request<IDashboard>('dashboard');
  }

  async starts(): Promise<{ time: number; starts: IStart[] }> {
    return this.request<{ time: number; starts: IStart[] }>('starts');
  }

  release(allocationId: string): Promise<unknown> {
    return this.request(`allocations/${encodeURIComponent(allocationId)}`, {
      method: 'DELETE'
    });
  }

  /** Change a share live (`PATCH`, acknowledged once the node agent enforces it). */
  resize(
    allocationId: string,
    change: { gpu_request?: number; gpu_limit?: number; gpu_memory?: number }
  ): Promise<IAllocation> {
    return this.request(`allocations/${encodeURIComponent(allocationId)}`, {
      method: 'PATCH',
      body: JSON.stringify(change)
    });
  }

  /**
   * Start a kernel holding `share`; resolves with the kernel model and its allocation. `wait`:
   * seconds the start may wait in the queue when the share does not fit now (queue.ts).
   */
  startKernel(
    name: string,
    path: string | undefined,
    share: IShare,
    wait?: number
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
      body: JSON.stringify({ name, path, share: wire, ...(wait !== undefined ? { wait } : {}) })
    });
  }
}
