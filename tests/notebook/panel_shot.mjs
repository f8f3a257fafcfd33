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
import { contrast, setTheme } from '../lab/labpage.mjs';

const { LAB_URL, LAB_TOKEN, ARTIFACTS, CHROMIUM, PLAYWRIGHT_FROM } = process.env;
const THEME = process.env.THEME || 'JupyterLab Light';
const tag = THEME.includes('Dark') ? 'dark' : 'light';
const { chromium } = createRequire(PLAYWRIGHT_FROM)('playwright-core');

await setTheme(LAB_URL, LAB_TOKEN, THEME); // before the page loads

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
  seen.contrast = await contrast(page, '.gpushare-panel');
  await panel.screenshot({ path: `${ARTIFACTS}/panel-${tag}.png` });
  await page.screenshot({ path: `${ARTIFACTS}/lab-${tag}.png` });
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await page.screenshot({ path: `${ARTIFACTS}/zz-failure-${tag}.png` }).catch(() => undefined);
}
await browser.close();
console.log(JSON.stringify({ ...seen, failed }));
process.exit(failed ? 1 : 0);
