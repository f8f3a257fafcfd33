// Browser driver for test_dashboard.py: the GPU dashboard, the picker's messages, start progress,
// the Kernel menu / toolbar / status bar entry points and a quiet cancel, in one JupyterLab
// theme (PARAMS.theme). Contrast of every text on its background is computed in the page from
// getComputedStyle (WCAG 2 relative luminance). Screenshots go to $ARTIFACTS/<theme>-*.png; the
// last stdout line is a JSON object of what was seen.
import { chromium } from 'playwright-core';
import { GPU_WORK, contrast as measureContrast, setTheme } from './labpage.mjs';

const { LAB_URL, ARTIFACTS, CHROMIUM } = process.env;
const params = JSON.parse(process.env.PARAMS || '{}');
const LAB_TOKEN = params.token || process.env.LAB_TOKEN; // whose browser this is
const tag = params.theme.includes('Dark') ? 'dark' : 'light';
const seen = { theme: params.theme };

const rest = async (path, init = {}) => {
  const response = await fetch(`${LAB_URL}${path}`, {
    ...init,
    headers: { Authorization: `token ${LAB_TOKEN}`, 'Content-Type': 'application/json' }
  });
  const text = await response.text();
  return text ? JSON.parse(text) : {};
};

await setTheme(LAB_URL, LAB_TOKEN, params.theme); // before the page loads

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

const contrast = selector => measureContrast(page, selector);

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
