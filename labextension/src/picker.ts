/**
 * The GPU share picker: a dialog that shows the GPU types with their free capacity now, the
 * admin's presets, and fields for request, limit, memory and type; then starts the kernel with
 * the chosen share through `POST /gpushare/api/kernels`. Each field is checked as it is typed
 * (its message under it, in the field's words; the space is kept, so the dialog does not move),
 * and the share as typed is checked against what the GPUs have free (`fit.ts`): before Start the
 * dialog says whether it fits and, where not, why and what would ("Use" fills it in, request and
 * limit together). A refusal (the server's 400 `invalid_share` or 409 `no_fit`) reopens the
 * dialog with the explanation.
 *
 * For a running kernel ("Restart with a new GPU share") the same dialog says that a restart loses
 * the kernel's state, and offers a live change (`PATCH /gpushare/api/allocations/{id}`, the
 * kernel keeps running) where the new share fits on the kernel's GPU.
 *
 * The rounds (dialog, check, start, refusal) are one function, `pickRounds`; a start that waits
 * for capacity (“Wait in line”, where the share does not fit and the server has a queue) is one
 * more outcome of a round, in `queue.ts`.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import type { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, GpushareRefusal, IAllocation, IInventory, IPresets } from './api';
import { fitOf } from './fit';
import { ProgressBody, StartProgress } from './progress';
import { IQueueOffer, queueOffer, startWaiting, waitOffer } from './queue';
import {
  defaultLimit,
  describeShare,
  fieldProblems,
  formatBytes,
  formatPercent,
  formatRange,
  IShare,
  IShareFields,
  parseShare,
  ShareError
} from './share';

/** Why the last attempt was refused, shown at the top of the reopened dialog. */
interface IProblem {
  message: string;
  field?: string;
  /** The server's code (`no_fit`, `invalid_share`, …). */
  code?: string;
  suggestions?: string[];
}

/** The picker for a running kernel ("Restart with a new share"): its share now. */
export interface IChange {
  allocation: IAllocation | null;
}

interface IPickerOptions {
  kernelLabel: string;
  /** The kernelspec asks for whole GPUs (request = limit = 1, or several GPUs). */
  whole?: boolean;
  inventory: IInventory;
  presets: IPresets;
  fields: IShareFields;
  problem: IProblem | null;
  /** The default share's limit: an empty Limit is the larger of it and the request. */
  baseLimit: number;
  /** Set for a running kernel: the dialog offers a live change and says what a restart costs. */
  change?: IChange;
  /** Where the server has a queue: a share that does not fit may wait in line (queue.ts). */
  queue?: IQueueOffer;
}

/** A share as the picker's fields; memory may be bytes or text (`10GiB`, from a kernelspec). */
function fieldsOf(share: Partial<Omit<IShare, 'gpu_memory'>> & { gpu_memory?: unknown }): IShareFields {
  const memory = share.gpu_memory;
  return {
    gpu_request: share.gpu_request !== undefined ? String(share.gpu_request) : '0.25',
    gpu_limit: share.gpu_limit !== undefined ? String(share.gpu_limit) : '',
    gpu_memory:
      typeof memory === 'number' ? formatBytes(memory) : typeof memory === 'string' ? memory : '',
    gpu_type: share.gpu_type ?? ''
  };
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: Partial<HTMLElementTagNameMap[K]> & { className?: string } = {},
  ...children: (Node | string)[]
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) {
    node.append(child);
  }
  return node;
}

/**
 * A placement suggestion such as `0.5 on A100` (see placement/explain.py) as field values, or
 * null when it has another form (then it is only shown).
 */
export function parseSuggestion(text: string): { request: string; type: string } | null {
  const match = /^\s*(\d*\.?\d+)\s+on\s+(?:an?\s+)?([A-Za-z0-9][A-Za-z0-9 _.-]*?)\s*$/.exec(text);
  return match ? { request: match[1], type: match[2] } : null;
}

/** Dialog button labels (tests and docs name them). */
export const START_LABEL = 'Start kernel';
export const LIVE_LABEL = 'Change live (no restart)';
export const RESTART_LABEL = 'Restart with new share';

/** The dialog body; `getValue()` returns the fields as typed. */
export class SharePicker extends Widget implements Dialog.IBodyWidget<IShareFields> {
  private inputs: Record<keyof IShareFields, HTMLInputElement | HTMLSelectElement>;
  private errors = {} as Record<keyof IShareFields, HTMLElement>;
  private percents = {} as Record<'gpu_request' | 'gpu_limit', HTMLElement>;
  private summary: HTMLElement;
  private fitLine: HTMLElement;
  private live: HTMLElement | null = null;
  /** Whether the share as typed can be applied to the running kernel without a restart. */
  liveAllowed = false;
  /** “Wait in line” is offered (the share does not fit now) and chosen (queue.ts). */
  waitChosen = false;
  private waitOffered = false;

  /** Whether Start should wait in line: offered for the share as typed, and chosen. */
  get waits(): boolean {
    return this.waitOffered && this.waitChosen;
  }

  constructor(private options: IPickerOptions) {
    super();
    this.addClass('jp-gpushare-picker');
    const { inventory, presets, fields, problem, change } = options;
    const root = this.node;
    root.append(
      el('p', {
        className: 'jp-gpushare-intro',
        textContent: options.whole
          ? `${options.kernelLabel} runs on a whole GPU. Choose the GPU type; ` +
            'the request and limit are the whole GPU.'
          : `${options.kernelLabel} runs on a share of a GPU. ` +
            'Request is the guaranteed fraction; the kernel may use idle time up to the limit.'
      })
    );
    if (change) {
      root.append(
        el('p', {
          className: 'jp-gpushare-restart-warning',
          textContent:
            `“${RESTART_LABEL}” stops this kernel and starts a new one: its variables, ` +
            'imports and running work (threads included) are lost.'
        })
      );
    }
    if (inventory.simulated) {
      root.append(
        el('p', {
          className: 'jp-gpushare-simulated',
          textContent: 'These GPUs are simulated (no real GPU on this machine).'
        })
      );
    }
    if (problem) {
      root.append(this.renderProblem(problem));
    }
    root.append(this.renderTypes(inventory));
    const typeSelect = el('select', { name: 'gpu_type', className: 'jp-mod-styled' });
    typeSelect.append(el('option', { value: '', textContent: 'any' }));
    for (const t of inventory.types) {
      typeSelect.append(el('option', { value: t.type, textContent: t.type }));
    }
    typeSelect.value = fields.gpu_type;
    this.inputs = {
      gpu_request: this.input('gpu_request', fields.gpu_request, 'e.g. 0.25'),
      gpu_limit: this.input(
        'gpu_limit',
        fields.gpu_limit,
        `empty: ${options.baseLimit} or the request`
      ),
      gpu_memory: this.input('gpu_memory', fields.gpu_memory, 'auto: request × GPU memory'),
      gpu_type: typeSelect
    };
    if (presets.presets.length) {
      root.append(this.renderPresets(presets));
    }
    const form = el('div', { className: 'jp-gpushare-fields' });
    const labels: [keyof IShareFields, string][] = [
      ['gpu_request', 'Request (fraction of a GPU)'],
      [
        'gpu_limit',
        `Limit (fraction; empty: the larger of ${options.baseLimit} and the request)`
      ],
      ['gpu_memory', 'Memory (e.g. 10GiB; empty: request × GPU memory)'],
      ['gpu_type', 'GPU type']
    ];
    for (const [key, text] of labels) {
      const row = el('span', { className: 'jp-gpushare-field-row' }, this.inputs[key]);
      if (key === 'gpu_request' || key === 'gpu_limit') {
        this.percents[key] = el('span', { className: 'jp-gpushare-percent' });
        row.append(this.percents[key]);
      }
      // room for one message is kept under every field: typing never moves the dialog
      this.errors[key] = el('span', { className: 'jp-gpushare-field-error' });
      this.errors[key].setAttribute('aria-live', 'polite');
      const label = el('label', {}, el('span', { textContent: text }), row, this.errors[key]);
      label.dataset.field = key;
      if (problem?.field && problem.field.split('.')[0] === key) {
        label.classList.add('jp-gpushare-invalid');
      }
      form.append(label);
      this.inputs[key].addEventListener('input', () => this.recheck());
      this.inputs[key].addEventListener('change', () => this.recheck());
    }
    root.append(form);
    this.summary = el('p', { className: 'jp-gpushare-summary' });
    this.fitLine = el('div', { className: 'jp-gpushare-fit' });
    root.append(this.summary, this.fitLine);
    if (change) {
      this.live = el('p', { className: 'jp-gpushare-live-note' });
      root.append(this.live);
    }
    this.recheck();
  }

  getValue(): IShareFields {
    return {
      gpu_request: this.inputs.gpu_request.value,
      gpu_limit: this.inputs.gpu_limit.value,
      gpu_memory: this.inputs.gpu_memory.value,
      gpu_type: this.inputs.gpu_type.value
    };
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.recheck();
  }

  /** The share as typed, or null while a field is wrong. */
  private share(): IShare | null {
    try {
      return parseShare(
        this.getValue(),
        this.options.inventory.types.map(t => t.type),
        this.options.baseLimit
      );
    } catch (err) {
      if (err instanceof ShareError) {
        return null;
      }
      throw err;
    }
  }

  /** Everything that follows the fields, again: messages, percents, summary, fit, live. */
  recheck(): void {
    const values = this.getValue();
    const problems = fieldProblems(
      values,
      this.options.inventory.types.map(t => t.type),
      this.options.baseLimit
    );
    for (const key of Object.keys(this.errors) as (keyof IShareFields)[]) {
      const text = problems[key] ?? '';
      this.errors[key].textContent = text;
      this.errors[key].title = text;
      this.inputs[key].setAttribute('aria-invalid', text ? 'true' : 'false');
      this.errors[key].parentElement?.classList.toggle('jp-gpushare-invalid', !!text);
    }
    for (const key of ['gpu_request', 'gpu_limit'] as const) {
      const text = values[key].trim();
      const value = Number(text);
      this.percents[key].textContent =
        text !== '' && Number.isFinite(value) && !problems[key] ? `= ${formatPercent(value)}` : '';
    }
    const share = this.share();
    this.fitLine.replaceChildren();
    this.waitOffered = false;
    if (!share) {
      this.summary.textContent = 'Correct the field marked above.';
      this.fitLine.dataset.fits = 'unknown';
      this.setLive(null, 'the fields above need correcting first');
      return;
    }
    const memory =
      share.gpu_memory !== null ? formatBytes(share.gpu_memory) : 'request × the GPU’s memory';
    const verb = this.options.change ? 'New share' : 'Start with';
    this.summary.textContent = `${verb}: ${formatRange(share.gpu_request, share.gpu_limit)} of ${
      share.gpu_type ? `${/^[AEFHILMNORSX]/i.test(share.gpu_type) ? 'an' : 'a'} ${share.gpu_type}` : 'any GPU'
    }, memory ${memory}.`;
    if (this.options.change) {
      const why = liveProblem(share, this.options.change.allocation, this.options.inventory);
      this.setLive(why === null ? share : null, why ?? '');
      this.renderFit(share, why === null);
    } else {
      this.renderFit(share, false);
    }
  }

  /**
   * The fit line: fits, or why not and the largest request that fits ("Use"). For a running
   * kernel whose share can change live, where it fits next to what the kernel holds; else what
   * a restart needs (the new kernel is placed before the old one stops).
   */
  private renderFit(share: IShare, live: boolean): void {
    const held = this.options.change?.allocation;
    if (live && held) {
      const fit = fitOf({ ...share, gpu_type: null }, this.options.inventory, {
        gpus: held.gpus,
        request: held.gpu_request,
        memory: held.gpu_memory
      });
      this.fitLine.dataset.fits = 'yes';
      this.fitLine.append(el('span', { className: 'jp-gpushare-fit-message', textContent: fit.message }));
      return;
    }
    const fit = fitOf(share, this.options.inventory);
    const message = this.options.change ? `For a restart: ${fit.message}` : fit.message;
    this.fitLine.dataset.fits = fit.fits ? 'yes' : 'no';
    this.fitLine.append(el('span', { className: 'jp-gpushare-fit-message', textContent: message }));
    const queue = this.options.queue;
    this.waitOffered = !fit.fits && !this.options.change && !!queue?.enabled;
    if (this.waitOffered && queue) {
      this.fitLine.append(waitOffer(queue, this.waitChosen, wait => (this.waitChosen = wait)));
    }
    if (!fit.fits && fit.suggestion) {
      const s = fit.suggestion;
      const limit = coherentLimit(share, s.request);
      const use = el('button', {
        className: 'jp-mod-styled jp-gpushare-use',
        textContent: `Use ${formatRange(s.request, limit)} of ${s.type}`,
        title: `Set request ${s.request} and limit ${limit} on ${s.type}`,
        type: 'button'
      });
      use.addEventListener('click', () => this.apply(s.request, limit, s.type));
      this.fitLine.append(' ', use);
    }
  }

  /** Fill in a request with its limit (and type): a suggestion's "Use". */
  private apply(request: number, limit: number, type?: string): void {
    this.inputs.gpu_request.value = String(request);
    this.inputs.gpu_limit.value = String(limit);
    const select = this.inputs.gpu_type as HTMLSelectElement;
    if (type && Array.from(select.options).some(o => o.value === type)) {
      select.value = type;
    }
    this.recheck();
  }

  private setLive(share: IShare | null, why: string): void {
    this.liveAllowed = share !== null;
    if (this.live) {
      this.live.textContent = share
        ? `“${LIVE_LABEL}” applies it now: this share fits on the kernel’s GPU, and the ` +
          'kernel keeps running with its state.'
        : `Only a restart gives this share: ${why}.`;
      this.live.dataset.live = share ? 'yes' : 'no';
    }
    const button = this.node
      .closest('.jp-Dialog')
      ?.querySelector<HTMLButtonElement>('button.jp-gpushare-live-button');
    if (button) {
      button.disabled = !this.liveAllowed;
      button.title = this.liveAllowed ? '' : `Not possible: ${why}`;
    }
  }

  private input(name: string, value: string, placeholder: string): HTMLInputElement {
    return el('input', { name, value, placeholder, className: 'jp-mod-styled' });
  }

  private renderProblem(problem: IProblem): HTMLElement {
    const box = el('div', { className: 'jp-gpushare-problem' });
    box.append(el('p', { className: 'jp-gpushare-problem-message', textContent: problem.message }));
    if (problem.suggestions?.length) {
      const list = el('ul', { className: 'jp-gpushare-suggestions' });
      for (const s of problem.suggestions) {
        const parsed = parseSuggestion(s);
        const request = parsed ? Number(parsed.request) : NaN;
        const item = el('li', {
          textContent: Number.isFinite(request)
            ? `would fit: ${formatPercent(request)} of ${parsed!.type} `
            : `would fit: ${s} `
        });
        if (parsed && Number.isFinite(request)) {
          const use = el('button', {
            className: 'jp-mod-styled jp-gpushare-use',
            textContent: 'Use',
            title: `Fill in ${formatPercent(request)} of ${parsed.type}`,
            type: 'button'
          });
          use.addEventListener('click', () => {
            const current = this.share();
            const limit = current ? coherentLimit(current, request) : defaultLimit(request, this.options.baseLimit);
            this.apply(request, limit, parsed.type);
          });
          item.append(use);
        }
        list.append(item);
      }
      box.append(list);
    }
    return box;
  }

  private renderTypes(inventory: IInventory): HTMLElement {
    if (!inventory.types.length) {
      return el('p', {
        className: 'jp-gpushare-problem',
        textContent: inventory.message || 'No GPU is available on this server.'
      });
    }
    const table = el('table', { className: 'jp-gpushare-types' });
    const head = el('tr');
    for (const h of ['Type', 'GPUs', 'Memory each', 'Most free compute', 'Most free memory']) {
      head.append(el('th', { textContent: h }));
    }
    table.append(el('thead', {}, head));
    const body = el('tbody');
    for (const t of inventory.types) {
      const row = el('tr', { title: `Use ${t.type}` });
      row.dataset.type = t.type;
      for (const cell of [
        t.type,
        String(t.count),
        formatBytes(t.memory),
        `${formatPercent(t.most_free_request)} of a GPU`,
        formatBytes(t.most_free_memory)
      ]) {
        row.append(el('td', { textContent: cell }));
      }
      row.addEventListener('click', () => {
        this.inputs.gpu_type.value = t.type;
        this.recheck();
      });
      body.append(row);
    }
    table.append(body);
    return table;
  }

  private renderPresets(presets: IPresets): HTMLElement {
    const bar = el('div', { className: 'jp-gpushare-presets' });
    bar.append(el('span', { textContent: 'Presets:' }));
    for (const preset of presets.presets) {
      const button = el('button', {
        className: 'jp-mod-styled jp-gpushare-preset',
        textContent: preset.name,
        title: describeShare(preset),
        type: 'button'
      });
      button.addEventListener('click', () => {
        const f = fieldsOf(preset);
        this.inputs.gpu_request.value = f.gpu_request;
        this.inputs.gpu_limit.value = f.gpu_limit;
        this.inputs.gpu_memory.value = f.gpu_memory;
        if (preset.gpu_type !== undefined) {
          this.inputs.gpu_type.value = f.gpu_type;
        }
        this.recheck();
      });
      bar.append(button);
    }
    return bar;
  }
}

/**
 * The limit that goes with a new request: the share keeps its burst in proportion (0.5–1 at
 * request 0.25 becomes 0.25–0.5), within (request, 1], in whole percents.
 */
export function coherentLimit(share: IShare, request: number): number {
  const ratio = share.gpu_request > 0 ? share.gpu_limit / share.gpu_request : 1;
  const limit = Math.round(request * ratio * 100) / 100;
  return Math.min(1, Math.max(request, limit));
}

/**
 * Why `share` cannot replace `allocation` live (the resize: same GPU, same type, what its GPU
 * has free next to the share it holds), or null when it can.
 */
export function liveProblem(
  share: IShare,
  allocation: IAllocation | null,
  inventory: IInventory
): string | null {
  if (!allocation) {
    return 'this kernel holds no GPU share now (released)';
  }
  if (allocation.gpu_count > 1) {
    return 'a share of several GPUs changes only with a restart';
  }
  if (share.gpu_type && share.gpu_type.toLowerCase() !== (allocation.gpu_type ?? '').toLowerCase()) {
    return `the GPU type changes (${allocation.gpu_type ?? 'any'} → ${share.gpu_type})`;
  }
  const gpu = inventory.gpus.find(g => allocation.gpus.includes(g.uuid));
  const memory = share.gpu_memory ?? (gpu ? Math.floor(share.gpu_request * gpu.memory) : null);
  const fit = fitOf({ ...share, gpu_memory: memory, gpu_type: null }, inventory, {
    gpus: allocation.gpus,
    request: allocation.gpu_request,
    memory: allocation.gpu_memory
  });
  return fit.fits ? null : fit.message.replace(/\.$/, '');
}

export interface IStarted {
  id: string;
  name: string;
  allocation: IAllocation | null;
}

/** What the change dialog did: nothing, a live change (the new allocation), or a restart. */
export type ChangeResult =
  | { kind: 'live'; allocation: IAllocation }
  | { kind: 'restart'; started: IStarted }
  | null;

interface IDialogRound {
  api: GpushareAPI;
  kernelName: string;
  kernelLabel: string;
  path: string | undefined;
  initial?: Partial<IShare> & { gpu_count?: number };
  progress?: StartProgress;
  change?: IChange;
}

/**
 * The picker's rounds: show the dialog; check what was chosen; start (or, for a running kernel,
 * change live or restart); on a refusal show the dialog again with the reason. Resolves with
 * what was done, or null when the user cancels.
 */
async function pickRounds(round: IDialogRound): Promise<ChangeResult> {
  const { api, kernelName, kernelLabel, path, initial, progress, change } = round;
  const whole =
    (initial?.gpu_count ?? 1) > 1 || (initial?.gpu_request === 1 && initial?.gpu_limit === 1);
  let inventory = await api.gpus();
  const presets = await api.presets().catch(
    (): IPresets => ({ default: { gpu_request: 0.25, gpu_limit: 0.5 }, presets: [] })
  );
  // the server's default (JupyterHub's pick, if any) overlaid with the kernelspec's own share
  const base = { ...presets.default, ...(initial ?? {}) };
  const baseLimit = base.gpu_limit ?? 0.5;
  const held = change?.allocation;
  let fields = held
    ? fieldsOf({
        gpu_request: held.gpu_request,
        gpu_limit: held.gpu_limit,
        gpu_memory: held.gpu_memory,
        gpu_type: held.gpu_type ?? undefined
      })
    : fieldsOf(base);
  let problem: IProblem | null = null;
  // a share that does not fit may wait in line where the server has a queue (queue.ts)
  const queue = !change && progress ? await queueOffer(api) : undefined;
  for (;;) {
    const body = new SharePicker({
      queue,
      kernelLabel,
      whole,
      inventory,
      presets,
      fields,
      problem,
      baseLimit,
      change
    });
    const buttons = change
      ? [
          Dialog.cancelButton(),
          Dialog.createButton({
            label: LIVE_LABEL,
            accept: true,
            className: 'jp-gpushare-live-button'
          }),
          Dialog.warnButton({ label: RESTART_LABEL, className: 'jp-gpushare-restart-button' })
        ]
      : [Dialog.cancelButton(), Dialog.okButton({ label: START_LABEL })];
    const result = await showDialog({
      title: change
        ? `Change the GPU share of ${path ? `${path.split('/').pop()}’s kernel` : kernelLabel}`
        : 'Choose a GPU share',
      body,
      buttons,
      defaultButton: change ? (body.liveAllowed ? 1 : 2) : 1,
      focusNodeSelector: 'input[name="gpu_request"]'
    });
    if (!result.button.accept || !result.value) {
      return null;
    }
    fields = result.value;
    let share: IShare;
    try {
      share = parseShare(fields, inventory.types.map(t => t.type), baseLimit);
    } catch (err) {
      if (err instanceof ShareError) {
        problem = { message: err.message, field: err.field };
        continue;
      }
      throw err;
    }
    try {
      if (change && held && result.button.label === LIVE_LABEL) {
        const gpu = inventory.gpus.find(g => held.gpus.includes(g.uuid));
        const memory = share.gpu_memory ?? (gpu ? Math.floor(share.gpu_request * gpu.memory) : null);
        const allocation = await api.resize(held.id, {
          gpu_request: share.gpu_request,
          gpu_limit: share.gpu_limit,
          ...(memory !== null ? { gpu_memory: memory } : {})
        });
        return { kind: 'live', allocation };
      }
      if (body.waits && queue && progress) {
        const waited = await startWaiting(api, progress, kernelName, kernelLabel, path, share, queue);
        if (waited.kind === 'cancelled') {
          return null;
        }
        if (waited.kind === 'started') {
          return { kind: 'restart', started: waited.started };
        }
        throw waited.error; // the wait ended without a start: the dialog again, with why
      }
      return {
        kind: 'restart',
        started: await startWithProgress(api, kernelName, kernelLabel, path, share, progress)
      };
    } catch (err) {
      if (!(err instanceof GpushareRefusal) || ![400, 409].includes(err.status)) {
        throw err;
      }
      inventory = await api.gpus();
      problem = refusalProblem(err, share, inventory);
    }
  }
}

/**
 * A refusal from the server as the dialog shows it: where the picker's own check now says the
 * share does not fit, that sentence (in percent, with "Use") says it once and the server's
 * words are not repeated; else the server's message and suggestions.
 */
function refusalProblem(err: GpushareRefusal, share: IShare, inventory: IInventory): IProblem | null {
  const afterWait = /in the queue|queued start/.test(err.body.message ?? '');
  if (err.body.error === 'no_fit' && !afterWait && !fitOf(share, inventory).fits) {
    return null;
  }
  return {
    message: err.body.message || err.message,
    field: err.body.field,
    code: err.body.error,
    suggestions: err.body.suggestions
  };
}

/**
 * Ask for a share and start kernel `kernelName` with it. Resolves with the started kernel, or
 * `null` when the user cancels.
 */
export async function pickAndStart(
  api: GpushareAPI,
  kernelName: string,
  kernelLabel: string,
  path: string | undefined,
  initial?: Partial<IShare> & { gpu_count?: number },
  progress?: StartProgress
): Promise<IStarted | null> {
  const done = await pickRounds({ api, kernelName, kernelLabel, path, initial, progress });
  return done && done.kind === 'restart' ? done.started : null;
}

/**
 * For a running kernel: pick a new share, then change it live (where it fits on the kernel's
 * GPU) or start a new kernel with it (the caller swaps it in: a restart).
 */
export function pickAndChange(
  api: GpushareAPI,
  kernelName: string,
  kernelLabel: string,
  path: string | undefined,
  allocation: IAllocation | null,
  initial?: Partial<IShare> & { gpu_count?: number },
  progress?: StartProgress
): Promise<ChangeResult> {
  return pickRounds({
    api,
    kernelName,
    kernelLabel,
    path,
    initial,
    progress,
    change: { allocation }
  });
}

/**
 * Start the kernel; while the server works, a dialog lists the start's phases as the server
 * reports them (placing, launching, … ready; on Kubernetes also scheduling and image pulling,
 * with the cluster's words). It closes by itself when the kernel is up or refused; "Hide" hides
 * it (the status bar keeps showing the phase).
 */
async function startWithProgress(
  api: GpushareAPI,
  kernelName: string,
  kernelLabel: string,
  path: string | undefined,
  share: IShare,
  progress?: StartProgress
): Promise<IStarted> {
  const request = api.startKernel(kernelName, path, share);
  if (!progress) {
    return request;
  }
  const body = new ProgressBody(progress, kernelLabel);
  const dialog = new Dialog({
    title: 'Starting kernel',
    body,
    buttons: [Dialog.cancelButton({ label: 'Hide', ariaLabel: 'Hide the start progress' })]
  });
  dialog.addClass('jp-gpushare-progress-dialog');
  const shown = dialog.launch();
  try {
    return await progress.watch(kernelName, request);
  } finally {
    if (!dialog.isDisposed) {
      dialog.resolve(0);
    }
    await shown.catch(() => undefined);
  }
}
