/**
 * Status-bar item: the current notebook kernel's GPU, its share and the share it achieves now,
 * all in percent of the GPU. Polls `/gpushare/api/allocations` and `/gpushare/api/usage` every
 * 2 s while a gpushare kernel is current; hidden otherwise. While a kernel starts it shows the
 * start's phase (`GET /gpushare/api/starts`, through {@link StartProgress}). Clicking it (or
 * Enter / Space when focused) opens the GPU dashboard.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, IAllocation, IInventory, IStart, IUsage } from './api';
import { phaseWords, StartProgress } from './progress';
import { describeShare, formatBytes, formatPercent, formatRange } from './share';

const POLL_MS = 2000;

export class GpuStatus extends Widget {
  private context: ISessionContext | null = null;
  private timer: number | null = null;
  private inventory: IInventory | null = null;
  /** The allocation shown now (used by the release command). */
  allocation: IAllocation | null = null;
  private _allocationChanged = new Signal<this, IAllocation | null>(this);
  private shownId: string | null = null;

  /** The current kernel's allocation changed (a share taken, released, or another kernel). */
  get allocationChanged(): ISignal<this, IAllocation | null> {
    return this._allocationChanged;
  }
  private starting: IStart | null = null;

  constructor(
    private api: GpushareAPI,
    private isGpushare: (kernelName: string) => boolean,
    progress: StartProgress,
    open: () => void
  ) {
    super();
    this.addClass('jp-gpushare-status');
    this.node.title = 'GPU share of this kernel';
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'button');
    this.node.addEventListener('click', open);
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        open();
      }
    });
    progress.changed.connect((_, start) => {
      this.starting = start && !start.ended ? start : null;
      if (this.starting) {
        this.setHidden(false);
        this.node.textContent = `GPU: ${phaseWords(this.starting.phase)}…`;
        this.node.dataset.phase = this.starting.phase;
        this.node.title = this.starting.message;
      } else {
        delete this.node.dataset.phase;
        this.refreshSoon();
      }
    });
  }

  /** Follow another notebook's session (or none). */
  track(context: ISessionContext | null): void {
    this.context?.kernelChanged.disconnect(this.refreshSoon, this);
    this.context = context;
    context?.kernelChanged.connect(this.refreshSoon, this);
    this.refreshSoon();
  }

  get kernelId(): string | null {
    return this.context?.session?.kernel?.id ?? null;
  }

  refreshSoon(): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
    }
    this.timer = window.setTimeout(() => void this.refresh(), 50);
  }

  private async refresh(): Promise<void> {
    this.timer = null;
    const kernel = this.context?.session?.kernel;
    if (!kernel || !this.isGpushare(kernel.name)) {
      this.allocation = null;
      this.render(null);
      return;
    }
    try {
      const [allocations, usage] = await Promise.all([
        this.api.allocations(),
        this.api.usage().catch(() => null)
      ]);
      if (!this.inventory) {
        this.inventory = await this.api.gpus();
      }
      this.allocation = allocations.find(a => a.kernel_id === kernel.id) ?? null;
      const live = usage?.allocations.find(u => u.id === this.allocation?.id) ?? null;
      this.render(this.allocation, live, usage?.daemon ?? false);
    } catch (err) {
      this.node.textContent = 'GPU: ?';
      this.node.title = `gpushare: ${err}`;
    }
    this.timer = window.setTimeout(() => void this.refresh(), POLL_MS);
  }

  private render(a: IAllocation | null, live: IUsage | null = null, metered = false): void {
    if ((a?.id ?? null) !== this.shownId) {
      this.shownId = a?.id ?? null;
      this._allocationChanged.emit(a);
    }
    if (this.starting) {
      return; // the start's phase is shown until it ends
    }
    if (a === null) {
      const kernel = this.context?.session?.kernel;
      const gpushare = kernel && this.isGpushare(kernel.name);
      this.node.textContent = gpushare ? 'GPU: none (released)' : '';
      this.node.title = gpushare ? 'This kernel holds no GPU share.' : '';
      this.setHidden(!gpushare);
      return;
    }
    this.setHidden(false);
    const gpus = (this.inventory?.gpus ?? []).filter(g => a.gpus.includes(g.uuid));
    const where = gpus.length ? gpus.map(g => `${g.type}#${g.index}`).join('+') : a.gpus.join(',');
    const achieved =
      live && live.achieved_share !== null
        ? `using ${formatPercent(live.achieved_share)}`
        : 'no use yet';
    const spec = formatRange(a.gpu_request, a.gpu_limit);
    this.node.textContent = `GPU ${where} · ${spec} · ${metered ? achieved : 'not measured'}`;
    this.node.dataset.allocation = a.id;
    this.node.title =
      `Allocation ${a.id}: ${describeShare(a)}` +
      (this.inventory?.simulated ? ' (simulated GPU)' : '') +
      (live?.memory_used != null ? `; memory in use ${formatBytes(live.memory_used)}` : '') +
      '. Click to open the GPU dashboard.';
  }

  dispose(): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
    }
    super.dispose();
  }
}
