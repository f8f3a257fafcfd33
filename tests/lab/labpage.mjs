// Shared by the browser drivers (tests/lab/dashboard.mjs, picker.mjs, share_flow.mjs,
// tests/notebook/panel_shot.mjs): GPU work for a kernel to run, a headless page and the steps in
// JupyterLab (launcher, palette, status bar) of the picker's drivers, the theme through Lab's
// settings API, and the contrast of every text on its background. No playwright import here: panel_shot.mjs
// resolves it its own way, so the callers pass their `chromium`.

// A kernel's context on the simulated GPU and its function `busy_us` (the simulator runs it for
// its argument's microseconds; the interposer meters and limits it), launched with 3 ms.
export const GPU_SETUP = `import ctypes, threading
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
cu.cuLaunchKernel.argtypes = [P] + [ctypes.c_uint] * 7 + [P, P, P]
dev, ctx, mod, fn = ctypes.c_int(), P(), P(), P()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuModuleLoadData(ctypes.byref(mod), b"any module") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us") == 0
us = ctypes.c_uint64(3000)
params = (P * 1)(ctypes.cast(ctypes.byref(us), P))`;

// Busy loop on the simulated GPU in a kernel thread.
export const GPU_WORK = `${GPU_SETUP}
def spin():
    cu.cuCtxSetCurrent(ctx)
    while True:
        cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        cu.cuCtxSynchronize()
threading.Thread(target=spin, daemon=True).start()
"busy"`;

/** A headless Chromium (`chromium` from the caller's playwright) and a page of `viewport`. */
export async function openPage(chromium, executablePath, viewport) {
  const browser = await chromium.launch({
    executablePath,
    headless: true,
    args: [
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
      '--disable-dev-shm-usage'
    ]
  });
  const page = await (await browser.newContext({ viewport })).newPage();
  return { browser, page };
}

/** Clicks the launcher's Notebook card of the kernelspec labelled `kernelLabel`. */
export async function newNotebookFromLauncher(page, kernelLabel) {
  await page
    .locator('.jp-LauncherCard[data-category="Notebook"]:visible', { hasText: kernelLabel })
    .first()
    .click();
}

/** Runs the command `text` from the command palette. */
export async function palette(page, text) {
  await page.keyboard.press('Control+Shift+C');
  const input = page.locator('.lm-CommandPalette-input');
  await input.waitFor();
  await input.fill(text);
  await page.locator('.lm-CommandPalette-item', { hasText: text }).first().click();
}

/** The status bar's gpushare item once it contains `contains`. */
export async function statusText(page, contains) {
  await page.waitForFunction(want => {
    const el = document.querySelector('.jp-gpushare-status');
    return !!el && el.textContent.includes(want);
  }, contains);
  return page.locator('.jp-gpushare-status').innerText();
}

/** Sets the JupyterLab theme through Lab's settings API (before the page loads). */
export async function setTheme(labUrl, token, theme) {
  const response = await fetch(`${labUrl}/lab/api/settings/@jupyterlab/apputils-extension:themes`, {
    method: 'PUT',
    headers: { Authorization: `token ${token}`, 'Content-Type': 'application/json' },
    body: JSON.stringify({ raw: JSON.stringify({ theme }) })
  });
  if (!response.ok) {
    throw new Error(`setting the theme: ${response.status} ${await response.text()}`);
  }
}

/** Every visible text under `selector` with its contrast ratio against what is behind it
 * (WCAG 2 relative luminance, from getComputedStyle), measured in `page`. */
export function contrast(page, selector) {
  return page.evaluate(contrastIn, selector);
}

// runs in the page: self-contained
function contrastIn(sel) {
  const parse = c => {
    const m = /rgba?\(([^)]+)\)/.exec(c || '');
    if (!m) {
      return null;
    }
    const p = m[1].split(/[\s,/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, base) => [0, 1, 2].map(i => top[i] * top[3] + base[i] * (1 - top[3]));
  const background = el => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) {
        layers.push(c);
        if (c[3] >= 1) {
          break;
        }
      }
    }
    let base = [255, 255, 255];
    for (const layer of layers.reverse()) {
      base = over(layer, base);
    }
    return base;
  };
  const lum = rgb => {
    const [r, g, b] = rgb.map(v => {
      const s = v / 255;
      return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const out = [];
  for (const root of document.querySelectorAll(sel)) {
    for (const el of [root, ...root.querySelectorAll('*')]) {
      const text = Array.from(el.childNodes)
        .filter(n => n.nodeType === Node.TEXT_NODE)
        .map(n => n.textContent.trim())
        .join(' ')
        .trim();
      if (!text || !el.getClientRects().length) {
        continue;
      }
      const style = getComputedStyle(el);
      if (style.visibility === 'hidden' || style.display === 'none' || Number(style.opacity) === 0) {
        continue;
      }
      const color = el instanceof SVGElement ? style.fill : style.color;
      const fg = parse(color);
      if (!fg) {
        continue;
      }
      const bg = background(el);
      const [a, b] = [lum(over(fg, bg)), lum(bg)].sort((x, y) => y - x);
      out.push({
        text: text.slice(0, 60),
        ratio: Math.round(((a + 0.05) / (b + 0.05)) * 100) / 100,
        color,
        background: `rgb(${bg.map(Math.round).join(',')})`
      });
    }
  }
  return out;
}
