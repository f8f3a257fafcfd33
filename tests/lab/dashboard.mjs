// Browser driver for test_dashboard.py: the GPU dashboard, the picker's messages, start progress,
// the Kernel menu / toolbar / status bar entry points and a quiet cancel, in one JupyterLab
// theme (PARAMS.theme). Contrast of every text on its background is computed in the page from
// getComputedStyle (WCAG 2 relative luminance). Screenshots go to $ARTIFACTS/<theme>-*.png; the
// last stdout line is a JSON object of what was seen.
import { chromium } from 'playwright-core';

const { LAB_URL, ARTIFACTS, CHROMIUM } = process.env;
const params = JSON.parse(process.env.PARAMS || '{}');
const LAB_TOKEN = params.token || process.env.LAB_TOKEN; // whose browser this is
const tag = params.theme.includes('Dark') ? 'dark' : 'light';
const seen = { theme: params.theme };

const GPU_WORK = `import ctypes, threading
cu = ctypes.CDLL("libcuda.so.1")
P = ctypes.c_void_p
cu.cuLaunchKernel.argtypes = [P] + [ctypes.c_uint] * 7 + [P, P, P]
dev, ctx, mod, fn = ctypes.c_int(), P(), P(), P()
assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0
assert cu.cuModuleLoadData(ctypes.byref(mod), b"any module") == 0
assert cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"busy_us") == 0
us = ctypes.c_uint64(3000)
params = (P * 1)(ctypes.cast(ctypes.byref(us), P))
def spin():
    cu.cuCtxSetCurrent(ctx)
    while True:
        cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
        cu.cuCtxSynchronize()
threading.Thread(target=spin, daemon=True).start()
"busy"`;

const rest = async (path, init = {}) => {
  const response = await fetch(`${LAB_URL}${path}`, {
    ...init,
    headers: { Authorization: `token ${LAB_TOKEN}`, 'Content-Type': 'application/json' }
  });
  const text = await response.text();
  return text ? JSON.parse(text) : {};
};

// the theme, through Lab's settings API, before the page loads
const themed = await fetch(`${LAB_URL}/lab/api/settings/@jupyterlab/apputils-extension:themes`, {
  method: 'PUT',
  headers: { Authorization: `token ${LAB_TOKEN}`, 'Content-Type': 'application/json' },
  body: JSON.stringify({ raw: JSON.stringify({ theme: params.theme }) })
});
if (!themed.ok) {
  throw new Error(`setting the theme: ${themed.status} ${await themed.text()}`);
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-dev-shm-usage']
});
const page = await (await browser.newContext({ viewport: { width: 1500, height: 950 } })).newPage();
page.setDefaultTimeout(60000);
page.on('console', msg => {
  if (msg.type() === 'error') {
    console.error(`[browser ${msg.type()}] ${msg.text()}`);
  }
});
const shot = name => page.screenshot({ path: `${ARTIFACTS}/${tag}-${name}.png` });
const dialog = page.locator('.jp-Dialog');
const picker = dialog.locator('.jp-gpushare-picker');

/** Every visible text under `selector` with its contrast ratio against what is behind it. */
async function contrast(selector) {
  return page.evaluate(sel => {
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
        const isSvg = el instanceof SVGElement;
        const fg = parse(isSvg ? style.fill : style.color);
        if (!fg) {
          continue;
        }
        const bg = background(el);
        const color = over(fg, bg);
        const [a, b] = [lum(color), lum(bg)].sort((x, y) => y - x);
        out.push({
          text: text.slice(0, 60),
          ratio: Math.round(((a + 0.05) / (b + 0.05)) * 100) / 100,
          color: style.color,
          background: `rgb(${bg.map(Math.round).join(',')})`
        });
      }
    }
    return out;
  }, selector);
}

async function newNotebook() {
  await page.locator('.lm-TabBar-addButton:not(.lm-mod-hidden)').first().click().catch(() => undefined);
  await page
    .locator('.jp-LauncherCard[data-category="Notebook"]:visible', { hasText: params.kernelLabel })
    .first()
    .click();
}

async function runCell(code) {
  const cells = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell');
  const cell = cells.nth((await cells.count()) - 1);
  await cell.locator('.cm-content').click();
  await page.keyboard.insertText(code);
  await page.keyboard.press('Shift+Enter');
  await cell.locator('.jp-OutputArea-output').first().waitFor();
}

let failed = null;
try {
  await page.goto(`${LAB_URL}/lab?reset&token=${LAB_TOKEN}`);
  await page.locator('.jp-LauncherCard').first().waitFor({ timeout: 90000 });
  seen.bodyTheme = await page.evaluate(() => document.body.dataset.jpThemeName);
  seen.launcherDashboard = await page
    .locator('.jp-LauncherCard', { hasText: 'GPU Dashboard' })
    .count();

  // 1. the picker's refusal text, in this theme
  await newNotebook();
  await picker.waitFor();
  await picker.locator('input[name="gpu_request"]').fill('0.6');
  await picker.locator('input[name="gpu_limit"]').fill('0.5');
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
  await picker.locator('.jp-gpushare-problem').waitFor();
  seen.refusal = await picker.locator('.jp-gpushare-problem').innerText();
  seen.pickerContrast = await contrast('.jp-Dialog-content');
  await shot('01-picker-refusal');

  // 2. a pick that fits; the start's phases come from the server
  await picker.locator('input[name="gpu_request"]').fill('0.25');
  await picker.locator('input[name="gpu_limit"]').fill('0.5');
  await picker.locator('select[name="gpu_type"]').selectOption('A100');
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
  const progressShown = await page
    .locator('.jp-gpushare-progress')
    .waitFor({ timeout: 5000 })
    .then(() => true)
    .catch(() => false);
  if (progressShown) {
    seen.progressContrast = await contrast('.jp-gpushare-progress');
    await shot('02-start-progress');
  }
  seen.progressShown = progressShown;
  await page.waitForFunction(() => {
    const el = document.querySelector('.jp-gpushare-status');
    return !!el && el.textContent.includes('A100');
  });
  seen.status = await page.locator('.jp-gpushare-status').innerText();
  seen.starts = (await rest('/gpushare/api/starts')).starts;
  await runCell(GPU_WORK);
  await page.waitForFunction(() => {
    const el = document.querySelector('.jp-gpushare-status');
    const m = el && /using (\d+) %/.exec(el.textContent);
    return !!m && Number(m[1]) > 0;
  });
  seen.statusBusy = await page.locator('.jp-gpushare-status').innerText();
  seen.statusContrast = await contrast('.jp-gpushare-status');

  // 3. the Kernel menu and the notebook toolbar carry the GPU commands
  await page.locator('.lm-MenuBar-itemLabel', { hasText: /^Kernel$/ }).click();
  const menu = page.locator('.lm-Menu:not(.lm-mod-hidden)').last();
  await menu.waitFor();
  seen.kernelMenu = await menu.locator('.lm-Menu-itemLabel').allInnerTexts();
  await shot('03-kernel-menu');
  await page.keyboard.press('Escape');
  seen.toolbar = await page
    .locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Toolbar [class*="jp-gpushare-toolbar-"]')
    .evaluateAll(nodes => nodes.map(n => n.className.match(/jp-gpushare-toolbar-\S+/)[0]));

  // 4. the status-bar item opens the dashboard (Enter on it, from the keyboard)
  await page.locator('.jp-gpushare-status').focus();
  await page.keyboard.press('Enter');
  const board = page.locator('#jp-gpushare-dashboard');
  await board.locator('.jp-gpushare-this-kernel[data-allocation]').waitFor();
  // live use of this kernel and the other user's share in the GPU table
  await page.waitForFunction(() => {
    const facts = document.querySelector('#jp-gpushare-dashboard .jp-gpushare-facts');
    const m = facts && /Using now\s*(\d+) %/.exec(facts.textContent);
    return !!m && Number(m[1]) > 0;
  });
  await board.locator('table.jp-gpushare-shares tbody tr').nth(1).waitFor();
  await page.waitForTimeout(4500); // two more samples: the charts draw a line
  seen.dashboardKernel = await board.locator('.jp-gpushare-this-kernel').innerText();
  seen.dashboardRows = await board.locator('table.jp-gpushare-shares tbody tr').allInnerTexts();
  seen.dashboardHeadings = await board.locator('h2, h3, h4').allInnerTexts();
  seen.dashboardNote = await board.locator('.jp-gpushare-note').innerText();
  seen.dashboardText = await board.innerText();
  seen.chartLabels = await board.locator('svg text').allTextContents();
  seen.legends = await board.locator('.jp-gpushare-legend').allInnerTexts();
  seen.polylines = await board.locator('svg polyline').count();
  seen.dashboardContrast = await contrast('#jp-gpushare-dashboard');
  seen.cellsAfterDashboard = await page
    .locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')
    .count();
  await shot('04-dashboard');
  // keyboard: the dashboard's buttons are reachable with Tab from the panel
  await board.focus();
  const reached = [];
  for (let i = 0; i < 4; i++) {
    await page.keyboard.press('Tab');
    reached.push(await page.evaluate(() => document.activeElement?.dataset?.command ?? ''));
  }
  seen.tabReached = reached;

  // 5. the in-notebook ipywidgets panel (jupyter_gpushare.panel()) in this theme
  await runCell('import jupyter_gpushare\njupyter_gpushare.panel()');
  const panel = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .gpushare-panel').first();
  await panel.waitFor();
  await page.waitForTimeout(3000); // a few updates: the plot and the live numbers
  seen.panelText = await panel.innerText();
  seen.panelContrast = await contrast('.jp-NotebookPanel:not(.lm-mod-hidden) .gpushare-panel');
  await panel.scrollIntoViewIfNeeded();
  await shot('06-panel');

  // 6. Escape in the picker: no error dialog, no kernel chooser, the notebook has no kernel
  const kernelsBefore = (await rest('/api/kernels')).length;
  await newNotebook();
  await picker.waitFor();
  await page.keyboard.press('Escape');
  await picker.waitFor({ state: 'detached' });
  await page.waitForTimeout(3000);
  seen.dialogsAfterCancel = await page.locator('.jp-Dialog').allInnerTexts();
  seen.kernelsAfterCancel = (await rest('/api/kernels')).length - kernelsBefore;
  seen.kernelNameAfterCancel = await page
    .locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-KernelName, .jp-NotebookPanel:not(.lm-mod-hidden) .jp-Toolbar-kernelName')
    .first()
    .innerText()
    .catch(() => '');
  await shot('05-cancelled');
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await shot('zz-failure').catch(() => undefined);
}
await browser.close();
console.log(JSON.stringify({ ...seen, failed }));
process.exit(failed ? 1 : 0);
