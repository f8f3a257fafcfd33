/**
 * Does a share fit now? The picker's one check before Start (and before a live change), from
 * `GET /gpushare/api/gpus`: the GPUs of the chosen type with their free compute and memory. The
 * server decides (placement, labels, a start racing this one); this says it before Start, in
 * percent as the picker's table, with the most that would fit as a suggestion.
 */
import { IGpu, IInventory } from './api';
import { formatBytes, formatPercent, IShare } from './share';

/** A share that may stay where it is: its GPU and what it holds there (a live change). */
export interface IHeld {
  gpus: string[];
  request: number;
  memory: number;
}

export interface IFit {
  fits: boolean;
  /** One sentence: where it fits, or why it does not (percent, the GPU type's name). */
  message: string;
  /** The largest request that fits now on a GPU of the asked type (with its type), if any. */
  suggestion: { request: number; type: string } | null;
}

const EPS = 1e-9;

function freeOn(gpu: IGpu, held?: IHeld): { request: number; memory: number } {
  const mine = held && held.gpus.includes(gpu.uuid);
  return {
    request: gpu.free_request + (mine ? held.request : 0),
    memory: gpu.free_memory + (mine ? held.memory : 0)
  };
}

function plural(n: number, word: string): string {
  return `${n} ${word}${n === 1 ? '' : 's'}`;
}

/**
 * Whether `share` fits now on a GPU of `inventory` (of its type, if it names one; only the
 * `held` share's GPUs when a live change is asked). Memory left empty is request × the GPU's
 * memory, as the server reckons it.
 */
export function fitOf(share: IShare, inventory: IInventory, held?: IHeld): IFit {
  const kind = share.gpu_type;
  let gpus = inventory.gpus.filter(
    g => !kind || g.type.toLowerCase() === kind.toLowerCase()
  );
  if (held) {
    gpus = gpus.filter(g => held.gpus.includes(g.uuid));
  }
  const name = kind ?? 'GPU';
  if (!gpus.length) {
    return {
      fits: false,
      message: kind ? `There is no ${kind} on this server.` : 'There is no GPU on this server.',
      suggestion: null
    };
  }
  const memoryOf = (g: IGpu) => share.gpu_memory ?? Math.floor(share.gpu_request * g.memory);
  const fitting = gpus.filter(g => {
    const free = freeOn(g, held);
    return free.request + EPS >= share.gpu_request && free.memory >= memoryOf(g);
  });
  if (fitting.length) {
    const best = fitting.reduce((a, b) => (freeOn(b, held).request > freeOn(a, held).request ? b : a));
    return {
      fits: true,
      message: held
        ? `Fits on this kernel’s ${best.type} #${best.index} (${formatPercent(freeOn(best, held).request)} free with its share).`
        : `Fits: ${best.type} #${best.index} has ${formatPercent(freeOn(best, held).request)} free.`,
      suggestion: null
    };
  }
  // the most a request may be on one of these GPUs (compute and, with auto memory, memory)
  let top: { request: number; gpu: IGpu } | null = null;
  for (const g of gpus) {
    const free = freeOn(g, held);
    let most = free.request;
    if (share.gpu_memory === null) {
      most = Math.min(most, free.memory / g.memory);
    } else if (free.memory < share.gpu_memory) {
      most = 0;
    }
    most = Math.floor(most * 100 + EPS) / 100;
    if (!top || most > top.request) {
      top = { request: most, gpu: g };
    }
  }
  const mostFree = Math.max(...gpus.map(g => freeOn(g, held).request));
  const mostMemory = Math.max(...gpus.map(g => freeOn(g, held).memory));
  const where = held ? `This kernel’s ${name}` : `No ${name}`;
  const count = held ? ' ' : ` ${plural(gpus.length, name)}, `;
  const need =
    share.gpu_memory !== null && mostMemory < share.gpu_memory
      ? `${formatBytes(share.gpu_memory)} of memory free:${count}the most free is ${formatBytes(mostMemory)}.`
      : `${formatPercent(share.gpu_request)} free:${count}the most free is ${formatPercent(mostFree)}.`;
  const message = held ? `${where} does not have ${need}` : `${where} has ${need}`;
  return {
    fits: false,
    message,
    suggestion:
      top && top.request >= 0.01 ? { request: top.request, type: top.gpu.type } : null
  };
}
