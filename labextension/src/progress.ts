/**
 * How far a kernel start has got: placing, placed, launching, scheduling, pulling, starting,
 * ready (or failed), with the cluster's words when it is slow. The server reports the phases
 * (`GET /gpushare/api/starts`, jupyter_gpushare/progress.py); while a start is under way this
 * polls it and tells the picker's progress dialog and the status bar.
 */
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, IStart } from './api';

const POLL_MS = 400;

/** The phases in order, with the words a user reads. */
export const PHASES: [string, string][] = [
  ['placing', 'Placing the GPU share'],
  ['placed', 'GPU share reserved'],
  ['launching', 'Starting the kernel'],
  ['scheduling', 'Waiting for the cluster to schedule the kernel pod'],
  ['pulling', 'Pulling the image / creating the container'],
  ['starting', 'Kernel process running, connecting'],
  ['ready', 'Kernel ready']
];

export function phaseWords(phase: string): string {
  if (phase === 'failed') {
    return 'Start failed';
  }
  return PHASES.find(([p]) => p === phase)?.[1] ?? phase;
}

export class StartProgress {
  private timer: number | null = null;
  private watching = 0;
  /** Starts begun before this server time are not ours (server clock: no client skew). */
  private after: number | null = null;
  private began = 0;
  private kernelName = '';
  private _changed = new Signal<this, IStart | null>(this);
  /** Every phase seen of the current start, in order (kept for the status bar's tooltip). */
  seen: string[] = [];
  current: IStart | null = null;

  constructor(private api: GpushareAPI) {}

  get changed(): ISignal<this, IStart | null> {
    return this._changed;
  }

  /** Watch the start of a `kernelName` kernel begun from now on, until `done` settles. */
  async watch<T>(kernelName: string, done: Promise<T>): Promise<T> {
    this.watching += 1;
    this.kernelName = kernelName;
    this.after = null;
    this.began = Date.now() / 1000;
    this.seen = [];
    this.current = null;
    this.poll();
    try {
      return await done;
    } finally {
      this.watching -= 1;
      await this.refresh().catch(() => undefined); // the last phase (ready or failed)
      if (this.watching === 0 && this.timer !== null) {
        window.clearTimeout(this.timer);
        this.timer = null;
      }
      window.setTimeout(() => {
        if (this.watching === 0) {
          this.current = null;
          this._changed.emit(null);
        }
      }, 3000);
    }
  }

  private poll(): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
    }
    this.timer = window.setTimeout(async () => {
      await this.refresh().catch(() => undefined);
      if (this.watching > 0) {
        this.poll();
      }
    }, POLL_MS);
  }

  private async refresh(): Promise<void> {
    const { time, starts } = await this.api.starts();
    if (this.after === null) {
      // the server's time when the watch began (its clock, not this browser's)
      this.after = time - (Date.now() / 1000 - this.began) - 1;
    }
    const after = this.after;
    const mine = starts
      .filter(s => s.since >= after && (!this.kernelName || s.kernel_name === this.kernelName))
      .pop();
    if (!mine) {
      return;
    }
    if (!this.seen.includes(mine.phase)) {
      this.seen.push(mine.phase);
    }
    this.current = mine;
    this._changed.emit(mine);
  }
}

/** The body of the "Starting kernel" dialog: the phases as a checklist, the current one's words. */
export class ProgressBody extends Widget {
  constructor(
    private progress: StartProgress,
    kernelLabel: string
  ) {
    super();
    this.addClass('jp-gpushare-progress');
    this.node.setAttribute('role', 'status');
    this.node.setAttribute('aria-live', 'polite');
    const intro = document.createElement('p');
    intro.textContent = `Starting ${kernelLabel}…`;
    this.node.append(intro, document.createElement('ol'), document.createElement('p'));
    progress.changed.connect(this.render, this);
    this.render();
  }

  private render(): void {
    const list = this.node.querySelector('ol')!;
    const detail = this.node.querySelectorAll('p')[1];
    const current = this.progress.current;
    const reached = PHASES.findIndex(([p]) => p === current?.phase);
    list.replaceChildren();
    for (const [index, [phase, words]] of PHASES.entries()) {
      const seen = current?.steps?.map(step => step.phase) ?? this.progress.seen;
      if ((phase === 'scheduling' || phase === 'pulling') && !seen.includes(phase)) {
        continue; // Kubernetes only
      }
      const item = document.createElement('li');
      item.dataset.phase = phase;
      const state = index < reached ? 'done' : index === reached ? 'now' : 'todo';
      item.className = `jp-gpushare-phase jp-mod-${state}`;
      item.textContent = `${state === 'done' ? '✓' : state === 'now' ? '▶' : '·'} ${words}`;
      list.append(item);
    }
    detail.className = 'jp-gpushare-progress-detail';
    detail.textContent = current?.message ?? 'Waiting for the server…';
  }

  dispose(): void {
    this.progress.changed.disconnect(this.render, this);
    super.dispose();
  }
}
