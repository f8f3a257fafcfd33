// Browser driver for test_panel_screenshot.py: the GPU panel rendered in a real JupyterLab, in
// Debian's headless Chromium, through playwright-core (installed in tests/lab/node_modules by
// .ci/setup.d/browser.sh; resolved from there with createRequire).
//
// Opens panel.ipynb (its kernel already runs: the test made the session) in the JupyterLab theme
// $THEME, runs its one cell, waits until the panel is live and its plot has a few seconds of
// history, and saves $ARTIFACTS/panel-<light|dark>.png (the panel) and lab-<light|dark>.png (the
// page). The last stdout line is a JSON object: the panel's data-field cells as shown, the state
// line, and the contrast of every text in the panel against what is behind it (WCAG 2).
import { createRequire } from 'node:module';

const { LAB_URL, LAB_TOKEN, ARTIFACTS, CHROMIUM, PLAYWRIGHT_FROM } = process.env;
const THEME = process.env.THEME || 'JupyterLab Light';
const tag = THEME.includes('Dark') ? 'dark' : 'light';
const { chromium } = createRequire(PLAYWRIGHT_FROM)('playwright-core');

// the theme, through Lab's settings API, before the page loads
await fetch(`${LAB_URL}/lab/api/settings/@jupyterlab/apputils-extension:themes`, {
  method: 'PUT',
  headers: { Authorization: `token ${LAB_TOKEN}`, 'Content-Type': 'application/json' },
  body: JSON.stringify({ raw: JSON.stringify({ theme: THEME }) })
});

/** Every visible text under `selector`: its contrast ratio against what is behind it. */
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
      if (style.visibility === 'hidden' || style.display === 'none') {
        continue;
      }
      const fg = parse(el instanceof SVGElement ? style.fill : style.color);
      if (!fg) {
        continue;
      }
      const bg = background(el);
      const [a, b] = [lum(over(fg, bg)), lum(bg)].sort((x, y) => y - x);
      out.push({
        text: text.slice(0, 60),
        ratio: Math.round(((a + 0.05) / (b + 0.05)) * 100) / 100,
        color: el instanceof SVGElement ? style.fill : style.color,
        background: `rgb(${bg.map(Math.round).join(',')})`
      });
    }
  }
  return out;
}

const browser = await chromium.launch({
  executablePath: CHROMIUM,
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--no-first-run', '--disable-dev-shm-usage',
    '--disable-background-networking', '--disable-component-update', '--disable-sync']
});
const page = await (await browser.newContext({ viewport: { width: 1200, height: 800 } })).newPage();
page.setDefaultTimeout(60000);
page.on('console', msg => {
  if (msg.type() === 'error') console.error(`[browser error] ${msg.text()}`);
});

const seen = {};
let failed = null;
try {
  await page.goto(`${LAB_URL}/lab/tree/panel.ipynb?reset&token=${LAB_TOKEN}`);
  const cell = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell').first();
  await cell.waitFor({ timeout: 90000 });
  // the notebook is connected to its (already running) kernel before the cell runs: running a
  // cell earlier makes Lab ask for a kernel
  await page.locator('.jp-StatusBar-Widget', { hasText: /\| Idle/ }).first()
    .waitFor({ timeout: 90000 });
  await cell.locator('.cm-content').click();
  await page.keyboard.press('Shift+Enter');
  const ask = page.locator('.jp-Dialog', { hasText: 'Select Kernel' });
  if (await ask.isVisible().catch(() => false)) {
    await ask.locator('button.jp-mod-accept').click();
  }
  const panel = page.locator('.gpushare-panel');
  await panel.waitFor({ timeout: 90000 });
  await page.waitForFunction(() => {
    const s = document.querySelector('.gpushare-panel [data-field="state"]');
    return s && s.textContent.trim() === 'active';
  });
  await page.waitForTimeout(6000); // a few seconds of history in the plot
  seen.fields = await panel.evaluate(el => Object.fromEntries(
    [...el.querySelectorAll('[data-field]')].map(c => [c.dataset.field, c.textContent.trim()])));
  seen.svg = await panel.locator('svg polyline').count();
  seen.release = await panel.getByRole('button', { name: /\bRelease$/ }).count();
  seen.theme = await page.evaluate(() => document.body.dataset.jpThemeName);
  seen.contrast = await page.evaluate(contrastIn, '.gpushare-panel');
  await panel.screenshot({ path: `${ARTIFACTS}/panel-${tag}.png` });
  await page.screenshot({ path: `${ARTIFACTS}/lab-${tag}.png` });
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await page.screenshot({ path: `${ARTIFACTS}/zz-failure-${tag}.png` }).catch(() => undefined);
}
await browser.close();
console.log(JSON.stringify({ ...seen, failed }));
process.exit(failed ? 1 : 0);
