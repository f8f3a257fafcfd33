/**
 * Client-side share validation, the same rules and messages as `jupyter_gpushare/share.py`
 * (`ShareSpec.from_mapping`), so that the picker refuses what the server would refuse before a
 * round trip. The server validates again; its answer wins.
 */

export interface IShare {
  gpu_request: number;
  gpu_limit: number;
  gpu_memory: number | null;
  gpu_type: string | null;
}

/** The raw text of the picker's fields. */
export interface IShareFields {
  gpu_request: string;
  gpu_limit: string;
  gpu_memory: string;
  gpu_type: string;
}

/** The picker's name for each field, the words its messages use. */
export const FIELD_WORDS: Record<keyof IShareFields, string> = {
  gpu_request: 'Request',
  gpu_limit: 'Limit',
  gpu_memory: 'Memory',
  gpu_type: 'GPU type'
};

/**
 * A value the picker refuses: `field` is the share key (`gpu_request`, as the server names it),
 * the message is in the form's words and units ("Request: 0.333 is not allowed: …").
 */
export class ShareError extends Error {
  constructor(
    readonly field: keyof IShareFields,
    readonly value: unknown,
    readonly allowed: string
  ) {
    super(`${FIELD_WORDS[field]}: ${JSON.stringify(String(value))} is not allowed: ${allowed}`);
  }
}

const UNITS: Record<string, number> = {
  '': 1,
  b: 1,
  k: 1e3,
  kb: 1e3,
  ki: 2 ** 10,
  kib: 2 ** 10,
  m: 1e6,
  mb: 1e6,
  mi: 2 ** 20,
  mib: 2 ** 20,
  g: 1e9,
  gb: 1e9,
  gi: 2 ** 30,
  gib: 2 ** 30,
  t: 1e12,
  tb: 1e12,
  ti: 2 ** 40,
  tib: 2 ** 40
};
const MEMORY_RE = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/;
const TYPE_RE = /^[A-Za-z0-9][A-Za-z0-9 _.-]{0,63}$/;
/** share.py's COMPUTE_UNIT: compute in whole percents. */
const STEP = 0.01;
const FRACTION = 'a fraction of the GPU from 0.01 to 1 (0.25 is 25 %)';

export function parseFraction(text: string, field: 'gpu_request' | 'gpu_limit'): number {
  const trimmed = text.trim();
  const value = Number(trimmed);
  if (trimmed === '' || !Number.isFinite(value) || value <= 0 || value > 1) {
    throw new ShareError(field, text, FRACTION);
  }
  if (Math.abs(value / STEP - Math.round(value / STEP)) > 1e-9) {
    const nearest = Math.max(STEP, Math.round(value / STEP) * STEP);
    throw new ShareError(
      field,
      text,
      `whole percents only, steps of 0.01 (${trimmed} is ${formatPercent1(value)}; ` +
        `nearest: ${+nearest.toFixed(2)} = ${formatPercent(nearest)})`
    );
  }
  return value;
}

function formatPercent1(fraction: number): string {
  return `${+(fraction * 100).toFixed(1)} %`;
}

export function parseMemory(text: string, field: 'gpu_memory' = 'gpu_memory'): number {
  const match = MEMORY_RE.exec(text);
  const unit = match ? match[2].toLowerCase() : '';
  if (!match || !(unit in UNITS)) {
    throw new ShareError(
      field,
      text,
      'a size such as 10GiB or 512MiB, or empty for request × the GPU’s memory'
    );
  }
  const bytes = Math.floor(Number(match[1]) * UNITS[unit]);
  if (bytes < 2 ** 20) {
    throw new ShareError(field, text, 'at least 1MiB');
  }
  return bytes;
}

/**
 * The one default-limit rule (share.py, `ShareSpec.from_mapping`; `jupyter gpushare run --help`
 * and the README say the same): without a limit, the limit is the default share's limit, or the
 * request where the request is larger.
 */
export function defaultLimit(request: number, baseLimit: number): number {
  return Math.max(baseLimit, request);
}

/**
 * Parse and check the picker's fields; throws {@link ShareError} naming the field. `baseLimit`:
 * the default share's limit, for an empty Limit ({@link defaultLimit}).
 */
export function parseShare(fields: IShareFields, types: string[], baseLimit = 0.5): IShare {
  const request = parseFraction(fields.gpu_request, 'gpu_request');
  const limitText = fields.gpu_limit.trim();
  const limit =
    limitText === '' ? defaultLimit(request, baseLimit) : parseFraction(limitText, 'gpu_limit');
  if (request > limit) {
    throw new ShareError(
      'gpu_request',
      fields.gpu_request,
      `at most the limit (${formatPercent(limit)}): the request is the guaranteed part of it`
    );
  }
  const memText = fields.gpu_memory.trim();
  const memory = memText === '' || memText === 'auto' ? null : parseMemory(memText);
  let gpuType: string | null = fields.gpu_type.trim();
  if (gpuType === '' || gpuType === 'any') {
    gpuType = null;
  } else if (!TYPE_RE.test(gpuType)) {
    throw new ShareError('gpu_type', gpuType, 'a GPU type name such as A100, H100 or T4');
  } else if (types.length && !types.some(t => t.toLowerCase() === gpuType!.toLowerCase())) {
    throw new ShareError('gpu_type', gpuType, `one of ${types.join(', ')} (or any)`);
  }
  return {
    gpu_request: request,
    gpu_limit: limit,
    gpu_memory: memory,
    gpu_type: gpuType
  };
}

/**
 * Each field's problem as the user types (the field's own words), or none: the Limit is checked
 * against the Request only once the Request itself is right.
 */
export function fieldProblems(
  fields: IShareFields,
  types: string[],
  baseLimit = 0.5
): Partial<Record<keyof IShareFields, string>> {
  const problems: Partial<Record<keyof IShareFields, string>> = {};
  const note = (f: () => void) => {
    try {
      f();
    } catch (err) {
      if (!(err instanceof ShareError)) {
        throw err;
      }
      problems[err.field] ??= err.message;
    }
  };
  note(() => parseFraction(fields.gpu_request, 'gpu_request'));
  if (fields.gpu_limit.trim() !== '') {
    note(() => parseFraction(fields.gpu_limit, 'gpu_limit'));
  }
  const memText = fields.gpu_memory.trim();
  if (memText !== '' && memText !== 'auto') {
    note(() => parseMemory(memText));
  }
  if (!problems.gpu_request && !problems.gpu_limit) {
    note(() => parseShare({ ...fields, gpu_memory: '', gpu_type: '' }, [], baseLimit));
  }
  note(() => parseShare({ ...fields, gpu_request: '1', gpu_limit: '1', gpu_memory: '' }, types));
  return problems;
}

/** `10737418240` -> `10GiB`, as `format_bytes` in share.py. */
export function formatBytes(n: number): string {
  const units: [string, number][] = [
    ['TiB', 2 ** 40],
    ['GiB', 2 ** 30],
    ['MiB', 2 ** 20],
    ['KiB', 2 ** 10]
  ];
  for (const [unit, size] of units) {
    if (n >= size) {
      return n % size === 0 ? `${n / size}${unit}` : `${(n / size).toFixed(1)}${unit}`;
    }
  }
  return `${n}B`;
}

/** `0.25–0.5 of an A100, 10GiB`, as `ShareSpec.describe`. */
export function describeShare(share: Partial<IShare>): string {
  const kind = share.gpu_type || 'GPU';
  const article = 'AEFHILMNORSX'.includes(kind[0].toUpperCase()) ? 'an' : 'a';
  const r = share.gpu_request ?? 0;
  const l = share.gpu_limit ?? r;
  let text = r === l ? `${r} of ${article} ${kind}` : `${r}–${l} of ${article} ${kind}`;
  if (share.gpu_memory) {
    text += `, ${formatBytes(share.gpu_memory)}`;
  }
  return text;
}

/** A fraction of a GPU as a percent, `0.49` -> `49 %` (the unit every gpushare view uses). */
export function formatPercent(fraction: number | null | undefined): string {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) {
    return '–';
  }
  return `${Math.round(fraction * 100)} %`;
}

/** Request and limit as percents: `25 %` or `25–50 %`. */
export function formatRange(request: number, limit: number): string {
  const r = Math.round(request * 100);
  const l = Math.round(limit * 100);
  return r === l ? `${r} %` : `${r}–${l} %`;
}
