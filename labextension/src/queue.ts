/**
 * Waiting in line (DESIGN box 13), the picker's one more outcome: where the chosen share does not
 * fit now and the server has a queue (`GET /gpushare/api/queue`: `enabled`, `max_wait`), the
 * picker's fit line offers “Wait in line”; Start then asks the server to wait (`"wait"` in
 * `POST /gpushare/api/kernels`, at most the admin's `GpuShare.start_wait_max`). While the start
 * waits, a dialog shows its place in line and the ETA in the queue's own sentence (the start's
 * progress, `GET /gpushare/api/starts`: “waiting: 1st in line for 0.25 of an A100; expected
 * within …”), updated as the server reports it, with “Cancel waiting”
 * (`DELETE /gpushare/api/queue/{entry}`). When a share frees, the kernel starts by itself and a
 * notification says so; a wait that ends without a start reopens the picker with the queue's
 * reason.
 */
import { Dialog, Notification } from '@jupyterlab/apputils';
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, GpushareRefusal, IStart } from './api';
import type { IStarted } from './picker';
import { StartProgress } from './progress';
import { IShare } from './share';

/** Dialog button labels (tests and docs name them). */
export const WAIT_LABEL = 'Wait in line';
export const CANCEL_WAIT_LABEL = 'Cancel waiting';

/** What the server's queue allows (`GET /gpushare/api/queue`). */
export interface IQueueOffer {
  enabled: boolean;
  /** The most seconds a start may ask to wait; 0: none. */
  max_wait: number;
}

interface IQueueEntry {
  id: string;
  state: string;
  position?: number;
  kernel_id?: string;
  message?: string;
}

async function call<T>(api: GpushareAPI, path: string, init: RequestInit = {}): Promise<T> {
  const url = URLExt.join(api.settings.baseUrl, 'gpushare', 'api', path);
  const response = await ServerConnection.makeRequest(url, init, api.settings);
  const text = await response.text();
  const body = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new GpushareRefusal(response.status, body);
  }
  return body as T;
}

/** Whether starts may wait here, and for how long; none when the server cannot say. */
export async function queueOffer(api: GpushareAPI): Promise<IQueueOffer> {
  try {
    const body = await call<{ enabled: boolean; max_wait?: number }>(api, 'queue');
    const max = Number(body.max_wait ?? 0);
    return { enabled: !!body.enabled && max > 0, max_wait: max };
  } catch {
    return { enabled: false, max_wait: 0 };
  }
}

function minutes(seconds: number): string {
  return seconds >= 5400 ? `${(seconds / 3600).toFixed(1)} h` : `${Math.round(seconds / 60)} min`;
}

/**
 * The “Wait in line” choice for the picker's fit line, where the share does not fit now.
 * `checked` is the choice so far (kept while the fields change); `onChange` gets each new one.
 */
export function waitOffer(
  offer: IQueueOffer,
  checked: boolean,
  onChange: (wait: boolean) => void
): HTMLElement {
  const label = document.createElement('label');
  label.className = 'jp-gpushare-wait-offer';
  const box = document.createElement('input');
  box.type = 'checkbox';
  box.name = 'gpushare_wait';
  box.checked = checked;
  box.addEventListener('change', () => onChange(box.checked));
  label.append(
    box,
    ` ${WAIT_LABEL}: Start queues this kernel (fair between users) and it starts by itself ` +
      `when a share frees; you see your place and an estimate, and may cancel (waits at most ` +
      `${minutes(offer.max_wait)}).`
  );
  return label;
}

/** A waiting start's words: the queue's own sentence, without the progress's prefix. */
export function waitingWords(start: IStart | null): string | null {
  const message = start?.message ?? '';
  return start && start.phase === 'placing' && message.startsWith('waiting: ')
    ? message.slice('waiting: '.length)
    : null;
}

/** The waiting dialog's body: the place in line and ETA, as the server last said it. */
class WaitingBody extends Widget {
  /** True once the start has been seen waiting in line. */
  waited = false;
  /** The queue's last sentence. */
  last = '';

  constructor(
    private progress: StartProgress,
    kernelLabel: string
  ) {
    super();
    this.addClass('jp-gpushare-waiting');
    this.node.setAttribute('role', 'status');
    this.node.setAttribute('aria-live', 'polite');
    const intro = document.createElement('p');
    intro.textContent = `${kernelLabel} waits for its GPU share; it starts by itself when one frees.`;
    const line = document.createElement('p');
    line.className = 'jp-gpushare-waiting-line';
    line.textContent = 'Joining the queue…';
    this.node.append(intro, line);
    progress.changed.connect(this.render, this);
  }

  private render(): void {
    const line = this.node.querySelector<HTMLElement>('.jp-gpushare-waiting-line')!;
    const current = this.progress.current;
    const words = waitingWords(current);
    if (words) {
      this.waited = true;
      this.last = words;
      line.textContent = words.charAt(0).toUpperCase() + words.slice(1) + '.';
      line.dataset.state = 'waiting';
    } else if (current && current.phase !== 'placing' && current.phase !== 'failed') {
      line.textContent = this.waited
        ? 'A share was freed: your kernel is starting.'
        : current.message || 'Starting…';
      line.dataset.state = 'starting';
    }
  }

  dispose(): void {
    this.progress.changed.disconnect(this.render, this);
    super.dispose();
  }
}

/** How a wait ended: started (by itself or at once), cancelled, or refused with the reason. */
export type WaitOutcome =
  | { kind: 'started'; started: IStarted; waited: boolean }
  | { kind: 'cancelled' }
  | { kind: 'refused'; error: GpushareRefusal };

/** Cancel this start's queue entry (found by the kernel id the start's progress names). */
async function cancelEntry(api: GpushareAPI, kernelId: string | undefined): Promise<void> {
  const { entries } = await call<{ entries: IQueueEntry[] }>(api, 'queue');
  const mine = entries.find(e => e.kernel_id && e.kernel_id === kernelId);
  if (mine) {
    await call(api, `queue/${encodeURIComponent(mine.id)}`, { method: 'DELETE' });
  }
}

/**
 * Start `kernelName` with `share`, waiting in line up to `offer.max_wait` seconds: a dialog
 * shows the place and ETA until the kernel starts (a notification then says it started by
 * itself), the user cancels (the queue entry is removed), or the wait ends (refused).
 */
export async function startWaiting(
  api: GpushareAPI,
  progress: StartProgress,
  kernelName: string,
  kernelLabel: string,
  path: string | undefined,
  share: IShare,
  offer: IQueueOffer
): Promise<WaitOutcome> {
  const request = api.startKernel(kernelName, path, share, offer.max_wait);
  const body = new WaitingBody(progress, kernelLabel);
  const dialog = new Dialog({
    title: 'Waiting for a GPU share',
    body,
    buttons: [
      Dialog.cancelButton({ label: 'Hide', ariaLabel: 'Hide; the kernel keeps its place in line' }),
      Dialog.warnButton({ label: CANCEL_WAIT_LABEL, className: 'jp-gpushare-cancel-wait' })
    ]
  });
  dialog.addClass('jp-gpushare-waiting-dialog');
  let cancelled = false;
  const shown = dialog.launch().then(async result => {
    if (result.button.label !== CANCEL_WAIT_LABEL) {
      return;
    }
    cancelled = true;
    try {
      await cancelEntry(api, progress.current?.kernel_id);
    } catch (err) {
      Notification.error(`Could not cancel the waiting start: ${(err as Error).message}`);
    }
  });
  try {
    const started = await progress.watch(kernelName, request);
    const waited = body.waited;
    if (waited) {
      const words = cancelled
        ? 'A share freed before the cancel arrived: the kernel started.'
        : `Your ${kernelLabel} kernel started by itself: a GPU share was freed ` +
          `(you were ${body.last.split(';')[0]}).`;
      Notification.success(words, { autoClose: 15000 });
    }
    return { kind: 'started', started, waited };
  } catch (err) {
    if (!(err instanceof GpushareRefusal)) {
      throw err;
    }
    if (cancelled) {
      Notification.info('Cancelled: the kernel start left the queue.', { autoClose: 5000 });
      return { kind: 'cancelled' };
    }
    return { kind: 'refused', error: err };
  } finally {
    if (!dialog.isDisposed) {
      dialog.resolve(0);
    }
    await shown.catch(() => undefined);
  }
}
