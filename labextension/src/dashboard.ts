/**
 * The GPU dashboard, in the right side bar or in the main area (wide: the GPUs side by side): the current notebook kernel's share live (what the
 * ipywidgets panel shows, without a notebook cell) and the node's or cluster's GPUs - per GPU
 * the shares on it, whose they are (user, notebook or command), request, limit, achieved share
 * and memory, live, with the last two minutes as a chart. Reads `GET /gpushare/api/dashboard`
 * every 2 s while it is shown; the server decides what this viewer may see (an admin sees every
 * user's shares, others their own and everyone else's as capacity only).
 *
 * Colours are JupyterLab's CSS variables only (style/index.css), so both themes work.
 */
import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { GpushareAPI, IDashboard, IDashboardGpu, IDashboardShare } from './api';
import { formatBytes, formatPercent, formatRange } from './share';

const POLL_MS = 2000;
/** History kept per GPU and per share: 60 samples of 2 s, two minutes. */
const HISTORY = 60;
const SVG = 'http://www.w3.org/2000/svg';

interface ISample {
  t: number;
  v: number | null;
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className = '',
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text) {
    node.textContent = text;
  }
  return node;
}

function svg<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number>
): SVGElementTagNameMap[K] {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, String(v));
  }
  return node;
}

/** Whose a share is, in words. */
export function whose(s: IDashboardShare): string {
  if (s.user === undefined) {
    return s.mine ? 'you' : 'another user';
  }
  const who = s.user || 'unknown user';
  return s.mine ? `${who} (you)` : who;
}

/** What holds a share: the notebook path, the command, a warm pool or the kernel id. */
export function what(s: IDashboardShare): string {
  if (s.path) {
    return s.path;
  }
  if (s.command) {
    return `$ ${s.command}`;
  }
  if (s.pool) {
    return `warm kernel of pool ${s.pool}`;
  }
  if (s.kernel_id) {
    return `kernel ${s.kernel_id.slice(0, 8)}`;
  }
  return s.id === undefined ? '(hidden)' : s.owner ?? '';
}

interface ILine {
  samples: ISample[];
  className: string;
  label: string;
}

interface IRule {
  value: number;
  className: string;
  label: string;
}

/**
 * A small line chart of shares over the last two minutes: y axis 0-100 % of the GPU with ticks,
 * x axis from "-2 min" to "now", dashed rules (request, limit, reserved), and a legend.
 */
export function chart(title: string, lines: ILine[], rules: IRule[], now: number): HTMLElement {
  const box = el('figure', 'jp-gpushare-chart');
  const width = 320;
  const height = 120;
  const left = 40;
  const bottom = 20;
  const top = 6;
  const right = 8;
  const plotW = width - left - right;
  const plotH = height - top - bottom;
  const x = (t: number) => left + plotW * (1 - Math.min(1, (now - t) / (HISTORY * 2)));
  const y = (v: number) => top + plotH * (1 - Math.max(0, Math.min(1, v)));
  const samples0 = lines[0]?.samples ?? [];
  const last = samples0.length ? samples0[samples0.length - 1].v : undefined;
  const root = svg('svg', {
    viewBox: `0 0 ${width} ${height}`,
    width: '100%',
    role: 'img',
    'aria-label': `${title}: ${last === undefined || last === null ? 'no data yet' : formatPercent(last) + ' now'}`
  });
  root.append(svg('rect', { x: left, y: top, width: plotW, height: plotH, class: 'jp-gpushare-plot-area' }));
  for (const tick of [0, 0.5, 1]) {
    root.append(svg('line', { x1: left, x2: left + plotW, y1: y(tick), y2: y(tick), class: 'jp-gpushare-grid' }));
    const label = svg('text', { x: left - 4, y: y(tick) + 4, 'text-anchor': 'end', class: 'jp-gpushare-axis-label' });
    label.textContent = `${tick * 100} %`;
    root.append(label);
  }
  root.append(svg('line', { x1: left, x2: left, y1: top, y2: top + plotH, class: 'jp-gpushare-axis' }));
  root.append(svg('line', { x1: left, x2: left + plotW, y1: top + plotH, y2: top + plotH, class: 'jp-gpushare-axis' }));
  for (const [t, text, anchor] of [
    [now - HISTORY * 2, '−2 min', 'start'],
    [now - HISTORY, '−1 min', 'middle'],
    [now, 'now', 'end']
  ] as [number, string, string][]) {
    const label = svg('text', { x: x(t), y: height - 4, 'text-anchor': anchor, class: 'jp-gpushare-axis-label' });
    label.textContent = text;
    root.append(label);
  }
  for (const line of lines) {
    const points = line.samples
      .filter(s => s.v !== null)
      .map(s => `${x(s.t).toFixed(1)},${y(s.v as number).toFixed(1)}`);
    if (points.length === 1) {
      points.push(points[0].replace(/^[^,]+/, String(left + plotW)));
    }
    if (points.length) {
      root.append(svg('polyline', { points: points.join(' '), class: `jp-gpushare-line ${line.className}` }));
    }
  }
  // the rules after the lines, so that they are drawn over them: "reserved 100 %" stays
  // visible where the use is 100 % too
  for (const rule of rules) {
    const line = svg('line', {
      x1: left,
      x2: left + plotW,
      y1: y(rule.value),
      y2: y(rule.value),
      class: `jp-gpushare-rule ${rule.className}`
    });
    line.dataset.series = rule.label;
    root.append(line);
  }
  const caption = el('figcaption', 'jp-gpushare-legend');
  for (const item of [...lines, ...rules]) {
    const entry = el('span', 'jp-gpushare-legend-item');
    // the swatch is the line itself (same class: same colour and dashes as in the chart, and
    // as the notebook panel's legend)
    const swatch = svg('svg', { width: 18, height: 8, class: 'jp-gpushare-swatch', 'aria-hidden': 'true' });
    swatch.append(
      svg('line', {
        x1: 0,
        x2: 18,
        y1: 4,
        y2: 4,
        class: `${'value' in item ? 'jp-gpushare-rule' : 'jp-gpushare-line'} ${item.className}`
      })
    );
    const value = 'value' in item ? ` ${formatPercent(item.value)}` : '';
    entry.append(swatch, document.createTextNode(`${item.label}${value}`));
    caption.append(entry);
  }
  box.append(el('div', 'jp-gpushare-chart-title', title), root, caption);
  return box;
}

/** Where a dashboard lives: the right side bar (narrow) or the main area (wide). */
export type DashboardArea = 'right' | 'main';

/** Wider than this, the GPUs are laid out side by side. */
const WIDE_PX = 720;

export interface ICurrentKernel {
  id: string;
  name: string;
  path: string;
}

export class GpuDashboard extends Widget {
  private timer: number | null = null;
  private data: IDashboard | null = null;
  private error = '';
  private history = new Map<string, ISample[]>();

  private resizeObserver: ResizeObserver;

  constructor(
    private api: GpushareAPI,
    private currentKernel: () => ICurrentKernel | null,
    private commands: CommandRegistry,
    readonly area: DashboardArea = 'right'
  ) {
    super();
    this.id = area === 'main' ? 'jp-gpushare-dashboard-main' : 'jp-gpushare-dashboard';
    this.addClass('jp-gpushare-dashboard');
    this.addClass(area === 'main' ? 'jp-mod-main' : 'jp-mod-side');
    this.resizeObserver = new ResizeObserver(() => {
      this.toggleClass('jp-mod-wide', this.node.clientWidth >= WIDE_PX);
    });
    this.resizeObserver.observe(this.node);
    this.title.label = area === 'main' ? 'GPU Dashboard' : 'GPUs';
    this.title.caption = 'GPU dashboard: this kernel’s share and the GPUs';
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU dashboard');
  }

  /** Refresh now (e.g. the current notebook changed, a share was released). */
  refreshSoon(): void {
    this.schedule(50);
  }

  protected onAfterShow(): void {
    this.schedule(0);
  }

  protected onAfterHide(): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
      this.timer = null;
    }
  }

  private schedule(ms: number): void {
    if (this.timer !== null) {
      window.clearTimeout(this.timer);
    }
    this.timer = window.setTimeout(() => void this.refresh(), ms);
  }

  private async refresh(): Promise<void> {
    this.timer = null;
    try {
      this.data = await this.api.dashboard();
      this.error = '';
      this.record(this.data);
    } catch (err) {
      this.error = `Could not read the GPUs: ${(err as Error).message ?? err}`;
    }
    this.render();
    if (this.isVisible) {
      this.schedule(POLL_MS);
    }
  }

  private record(data: IDashboard): void {
    if (data.history) {
      // the server's history (also sampled while this panel was closed)
      this.history.clear();
      for (const [kind, series] of [
        ['gpu', data.history.gpus],
        ['share', data.history.shares]
      ] as [string, Record<string, [number, number][]>][]) {
        for (const [key, points] of Object.entries(series)) {
          this.history.set(`${kind}:${key}`, points.map(([t, v]) => ({ t, v })));
        }
      }
      return;
    }
    const add = (key: string, v: number | null | undefined) => {
      const samples = this.history.get(key) ?? [];
      samples.push({ t: data.time, v: v ?? null });
      while (samples.length > HISTORY) {
        samples.shift();
      }
      this.history.set(key, samples);
    };
    for (const gpu of data.gpus) {
      add(`gpu:${gpu.uuid}`, gpu.achieved_share);
      for (const share of gpu.shares) {
        if (share.id) {
          add(`share:${share.id}`, share.achieved_share);
        }
      }
    }
  }

  private render(): void {
    const data = this.data;
    const root = this.node;
    const focused = document.activeElement?.getAttribute('data-focus-key');
    root.replaceChildren();
    root.append(el('h2', 'jp-gpushare-dashboard-title', 'GPU dashboard'));
    if (this.error) {
      root.append(el('p', 'jp-gpushare-problem', this.error));
    }
    if (!data) {
      root.append(el('p', '', 'Reading the GPUs…'));
      return;
    }
    const scope = el('p', 'jp-gpushare-note');
    scope.textContent =
      (data.admin
        ? 'You see every user’s shares.'
        : 'You see your own shares; other users’ shares show only what they reserve.') +
      (data.simulated ? ' These GPUs are simulated.' : '') +
      (data.metered ? '' : ' Live use is not available: ' + (data.message ?? 'no node daemon answers.'));
    root.append(scope);
    root.append(this.renderKernel(data));
    const section = el('section', 'jp-gpushare-gpus');
    section.setAttribute('aria-label', 'GPUs');
    section.append(el('h3', '', data.gpus.length === 1 ? 'The GPU' : `GPUs (${data.gpus.length})`));
    if (!data.gpus.length) {
      section.append(el('p', '', data.message ?? 'No GPU is published by any node.'));
    }
    for (const gpu of data.gpus) {
      section.append(this.renderGpu(gpu, data.time));
    }
    root.append(section);
    if (focused) {
      (root.querySelector(`[data-focus-key="${focused}"]`) as HTMLElement | null)?.focus();
    }
  }

  private renderKernel(data: IDashboard): HTMLElement {
    const section = el('section', 'jp-gpushare-this-kernel');
    section.setAttribute('aria-label', 'This kernel');
    section.append(el('h3', '', 'This kernel'));
    const kernel = this.currentKernel();
    if (!kernel) {
      section.append(el('p', '', 'Open a notebook with a GPU kernel to see its share here.'));
      return section;
    }
    let found: [IDashboardGpu, IDashboardShare] | null = null;
    for (const gpu of data.gpus) {
      const share = gpu.shares.find(s => s.kernel_id === kernel.id);
      if (share) {
        found = [gpu, share];
        break;
      }
    }
    if (!found) {
      section.append(el('p', '', `${kernel.path}: this kernel holds no GPU share.`));
      return section;
    }
    const [gpu, share] = found;
    section.dataset.allocation = share.id ?? '';
    const facts = el('dl', 'jp-gpushare-facts');
    const fact = (term: string, value: string) => {
      facts.append(el('dt', '', term), el('dd', '', value));
    };
    fact('Notebook', kernel.path);
    fact('GPU', `${gpu.type} #${gpu.index} on ${gpu.node}${gpu.simulated ? ' (simulated)' : ''}`);
    fact('Share', `${formatRange(share.request, share.limit)} of the GPU`);
    fact('Using now', share.metered ? formatPercent(share.achieved_share) : 'not measured');
    fact(
      'Memory',
      share.memory_used !== null && share.memory_used !== undefined
        ? `${formatBytes(share.memory_used)} of ${formatBytes(share.memory_cap)}`
        : `up to ${formatBytes(share.memory_cap)}`
    );
    section.append(facts);
    const rules: IRule[] = [{ value: share.request, className: 'jp-mod-request', label: 'request' }];
    if (share.limit !== share.request) {
      rules.push({ value: share.limit, className: 'jp-mod-limit', label: 'limit' });
    }
    section.append(
      chart(
        'This kernel’s use of the GPU',
        [{ samples: this.history.get(`share:${share.id}`) ?? [], className: 'jp-mod-mine', label: 'used' }],
        rules,
        data.time
      )
    );
    const actions = el('div', 'jp-gpushare-actions');
    for (const [command, text, key] of [
      ['gpushare:release', 'Release the GPU share', 'release'],
      ['gpushare:restart-with-share', 'Change the share…', 'restart']
    ]) {
      const button = el('button', 'jp-mod-styled jp-gpushare-button', text);
      button.type = 'button';
      button.dataset.focusKey = key;
      button.dataset.command = command;
      button.addEventListener('click', () => void this.commands.execute(command));
      actions.append(button);
    }
    section.append(actions);
    return section;
  }

  private renderGpu(gpu: IDashboardGpu, now: number): HTMLElement {
    const card = el('article', 'jp-gpushare-gpu');
    card.dataset.uuid = gpu.uuid;
    card.setAttribute('aria-label', `${gpu.type} #${gpu.index}`);
    card.append(
      el(
        'h4',
        '',
        `${gpu.type} #${gpu.index} · ${gpu.node} · ${formatBytes(gpu.memory)}` +
          (gpu.healthy ? '' : ' · unhealthy')
      )
    );
    card.append(
      el(
        'p',
        'jp-gpushare-gpu-summary',
        `Reserved ${formatPercent(gpu.reserved_request)}, free ${formatPercent(gpu.free_request)} ` +
          `and ${formatBytes(gpu.free_memory)}` +
          (gpu.achieved_share !== null ? ` · in use now ${formatPercent(gpu.achieved_share)}` : '')
      )
    );
    // capacity bar: each share's request, then what is free
    const bar = el('div', 'jp-gpushare-capacity');
    bar.setAttribute('role', 'img');
    bar.setAttribute(
      'aria-label',
      `${gpu.shares.length} share${gpu.shares.length === 1 ? '' : 's'}, ${formatPercent(gpu.free_request)} free`
    );
    for (const share of gpu.shares) {
      const part = el('span', `jp-gpushare-capacity-part ${share.mine ? 'jp-mod-mine' : 'jp-mod-other'}`);
      part.style.width = `${share.request * 100}%`;
      part.title = `${whose(share)}: ${formatRange(share.request, share.limit)}`;
      bar.append(part);
    }
    card.append(bar);
    card.append(
      chart(
        `${gpu.type} #${gpu.index}: use of the GPU`,
        [{ samples: this.history.get(`gpu:${gpu.uuid}`) ?? [], className: 'jp-mod-total', label: 'used (shares you see)' }],
        [{ value: gpu.reserved_request, className: 'jp-mod-reserved', label: 'reserved' }],
        now
      )
    );
    if (!gpu.shares.length) {
      card.append(el('p', '', 'No share on this GPU: all of it is free.'));
      return card;
    }
    // two columns, so it reads in a narrow side bar: who and what | share, use, memory
    const table = el('table', 'jp-gpushare-shares');
    const caption = el('caption', '', `Shares on ${gpu.type} #${gpu.index}`);
    const head = el('tr');
    for (const h of ['Whose, what', 'Share, use, memory']) {
      const th = el('th', '', h);
      th.scope = 'col';
      head.append(th);
    }
    table.append(caption, el('thead'), el('tbody'));
    table.tHead!.append(head);
    for (const share of gpu.shares) {
      const row = el('tr', share.mine ? 'jp-mod-mine' : '');
      if (share.id) {
        row.dataset.allocation = share.id;
      }
      const using =
        share.id === undefined
          ? 'use not shown'
          : share.metered
            ? `using ${formatPercent(share.achieved_share)}`
            : 'use not measured';
      const memory =
        share.memory_used !== null && share.memory_used !== undefined
          ? `${formatBytes(share.memory_used)} / ${formatBytes(share.memory_cap)}`
          : `up to ${formatBytes(share.memory_cap)}`;
      const who = el('td');
      // a notebook path or command on one line, cut with "…" (the whole in its tooltip), never
      // broken inside a file name
      const held = el('div', 'jp-gpushare-what', what(share));
      held.title = what(share);
      who.append(el('div', 'jp-gpushare-whose', whose(share)), held);
      const numbers = el('td');
      numbers.append(
        el('div', '', formatRange(share.request, share.limit)),
        el('div', '', using),
        el('div', '', memory)
      );
      row.append(who, numbers);
      table.tBodies[0].append(row);
    }
    card.append(table);
    return card;
  }

  dispose(): void {
    this.onAfterHide();
    this.resizeObserver.disconnect();
    super.dispose();
  }
}
