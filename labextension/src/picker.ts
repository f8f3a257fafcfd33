/**
 * The GPU share picker: a dialog that shows the GPU types with their free capacity now, the
 * admin's presets, and fields for request, limit, memory and type; then starts the kernel with
 * the chosen share through `POST /gpushare/api/kernels`. A refusal (the picker's own check, the
 * server's 400 `invalid_share` or 409 `no_fit`) reopens the dialog with the explanation and what
 * would fit.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, GpushareRefusal, IAllocation, IInventory, IPresets } from './api';
import { ProgressBody, StartProgress } from './progress';
import {
  describeShare,
  formatBytes,
  formatPercent,
  IShare,
  IShareFields,
  parseShare,
  ShareError
} from './share';

/** Why the last attempt was refused, shown at the top of the reopened dialog. */
interface IProblem {
  message: string;
  field?: string;
  suggestions?: string[];
}

interface IPickerOptions {
  kernelLabel: string;
  /** The kernelspec asks for whole GPUs (request = limit = 1, or several GPUs). */
  whole?: boolean;
  inventory: IInventory;
  presets: IPresets;
  fields: IShareFields;
  problem: IProblem | null;
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

/** The dialog body; `getValue()` returns the fields as typed. */
export class SharePicker extends Widget implements Dialog.IBodyWidget<IShareFields> {
  private inputs: Record<keyof IShareFields, HTMLInputElement | HTMLSelectElement>;

  constructor(options: IPickerOptions) {
    super();
    this.addClass('jp-gpushare-picker');
    const { inventory, presets, fields, problem } = options;
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
      gpu_limit: this.input('gpu_limit', fields.gpu_limit, 'same as request'),
      gpu_memory: this.input('gpu_memory', fields.gpu_memory, 'auto: request × GPU memory'),
      gpu_type: typeSelect
    };
    if (presets.presets.length) {
      root.append(this.renderPresets(presets));
    }
    const form = el('div', { className: 'jp-gpushare-fields' });
    const labels: [keyof IShareFields, string][] = [
      ['gpu_request', 'Request (fraction of a GPU, 0.25 = 25 %)'],
      ['gpu_limit', 'Limit (fraction, empty: same as request)'],
      ['gpu_memory', 'Memory'],
      ['gpu_type', 'GPU type']
    ];
    for (const [key, text] of labels) {
      const label = el('label', {}, el('span', { textContent: text }), this.inputs[key]);
      if (problem?.field && problem.field.split('.')[0] === key) {
        label.classList.add('jp-gpushare-invalid');
      }
      form.append(label);
    }
    root.append(form);
  }

  getValue(): IShareFields {
    return {
      gpu_request: this.inputs.gpu_request.value,
      gpu_limit: this.inputs.gpu_limit.value,
      gpu_memory: this.inputs.gpu_memory.value,
      gpu_type: this.inputs.gpu_type.value
    };
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
        const item = el('li', { textContent: `would fit: ${s} ` });
        const parsed = parseSuggestion(s);
        if (parsed) {
          const use = el('button', {
            className: 'jp-mod-styled jp-gpushare-preset jp-gpushare-use',
            textContent: 'Use',
            title: `Fill in ${s}`,
            type: 'button'
          });
          use.addEventListener('click', () => {
            this.inputs.gpu_request.value = parsed.request;
            if (Number(this.inputs.gpu_limit.value) < Number(parsed.request)) {
              this.inputs.gpu_limit.value = parsed.request;
            }
            const select = this.inputs.gpu_type as HTMLSelectElement;
            if (Array.from(select.options).some(o => o.value === parsed.type)) {
              select.value = parsed.type;
            }
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
      });
      bar.append(button);
    }
    return bar;
  }
}

export interface IStarted {
  id: string;
  name: string;
  allocation: IAllocation | null;
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
  const whole =
    (initial?.gpu_count ?? 1) > 1 || (initial?.gpu_request === 1 && initial?.gpu_limit === 1);
  let inventory = await api.gpus();
  const presets = await api.presets().catch(
    (): IPresets => ({ default: { gpu_request: 0.25, gpu_limit: 0.5 }, presets: [] })
  );
  // the server's default (JupyterHub's pick, if any) overlaid with the kernelspec's own share
  let fields = fieldsOf({ ...presets.default, ...(initial ?? {}) });
  let problem: IProblem | null = null;
  for (;;) {
    const body = new SharePicker({ kernelLabel, whole, inventory, presets, fields, problem });
    const result = await showDialog({
      title: 'Choose a GPU share',
      body,
      buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Start kernel' })],
      focusNodeSelector: 'input[name="gpu_request"]'
    });
    if (!result.button.accept || !result.value) {
      return null;
    }
    fields = result.value;
    let share: IShare;
    try {
      share = parseShare(fields, inventory.types.map(t => t.type));
    } catch (err) {
      if (err instanceof ShareError) {
        problem = { message: err.message, field: err.field };
        continue;
      }
      throw err;
    }
    try {
      return await startWithProgress(api, kernelName, kernelLabel, path, share, progress);
    } catch (err) {
      if (!(err instanceof GpushareRefusal) || ![400, 409].includes(err.status)) {
        throw err;
      }
      problem = {
        message: err.body.message || err.message,
        field: err.body.field,
        suggestions: err.body.suggestions
      };
      inventory = await api.gpus();
    }
  }
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
