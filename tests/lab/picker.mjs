// Browser driver for test_picker.py: real JupyterLab in Debian's headless Chromium.
//
// 1. New notebook with a gpushare kernel from the launcher -> the GPU share picker opens; pick
//    0.25 of an A100 with limit 0.5; the kernel starts; a cell prints the kernel's allocation.
// 2. Second notebook: an invalid pick (request above limit) is refused by the picker, then a pick
//    that does not fit is refused by the server with its explanation; then a pick that fits.
// 3. Palette command "Release GPU Share".
// 4. Escape/Cancel in the picker: quietly no kernel (no error dialog, no kernel chooser).
// Screenshots go to $ARTIFACTS; the last stdout line is a JSON object of what was seen.
import { chromium } from 'playwright-core';
import { GPU_WORK, newNotebookFromLauncher, openPage, palette, statusText } from './labpage.mjs';

const { LAB_URL, LAB_TOKEN, ARTIFACTS, CHROMIUM } = process.env;
const params = JSON.parse(process.env.PARAMS || '{}');
const seen = {};

const { browser, page } = await openPage(chromium, CHROMIUM, { width: 1400, height: 900 });
page.setDefaultTimeout(60000);
page.on('console', msg => {
  if (msg.type() === 'error' || msg.type() === 'warning') {
    console.error(`[browser ${msg.type()}] ${msg.text()}`);
  }
});
const rest = async path => {
  const response = await fetch(`${LAB_URL}${path}`, {
    headers: { Authorization: `token ${LAB_TOKEN}` }
  });
  return response.json();
};
const shot = name => page.screenshot({ path: `${ARTIFACTS}/${name}.png` });
const dialog = page.locator('.jp-Dialog');
const picker = dialog.locator('.jp-gpushare-picker');

async function fillPicker({ request, limit, memory = '', type = '' }) {
  await picker.waitFor();
  await picker.locator('input[name="gpu_request"]').fill(request);
  await picker.locator('input[name="gpu_limit"]').fill(limit);
  await picker.locator('input[name="gpu_memory"]').fill(memory);
  await picker.locator('select[name="gpu_type"]').selectOption(type);
}

async function accept() {
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
}

async function runCell(code) {
  const cells = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell');
  const cell = cells.nth((await cells.count()) - 1); // fixed index: Shift+Enter adds a cell
  await cell.locator('.cm-content').click();
  await page.keyboard.insertText(code); // as a paste: no auto-indent or bracket closing
  await page.keyboard.press('Shift+Enter');
  const output = cell.locator('.jp-OutputArea-output');
  await output.first().waitFor();
  return (await output.allInnerTexts()).join('\n');
}

let failed = null;
try {
  await page.goto(`${LAB_URL}/lab?reset&token=${LAB_TOKEN}`);
  await page.locator('.jp-LauncherCard').first().waitFor({ timeout: 90000 });
  await shot('01-launcher');

  // 1. pick 0.25 of an A100 with limit 0.5
  await newNotebookFromLauncher(page, params.kernelLabel);
  await fillPicker({ request: '0.25', limit: '0.5', type: 'A100' });
  seen.pickerTypes = await picker.locator('table.jp-gpushare-types tbody tr').allInnerTexts();
  await shot('02-picker');
  await accept();
  await dialog.waitFor({ state: 'detached' });
  seen.status1 = await statusText(page, 'A100');
  seen.cell1 = await runCell(
    'import os; os.environ["GPUSHARE_ALLOCATION_ID"] + " " + os.environ["CUDA_VISIBLE_DEVICES"]'
  );
  await shot('03-kernel-running');
  // GPU work on the simulated GPU: the status bar shows the share achieved now
  await runCell(GPU_WORK);
  await page.waitForFunction(() => {
    const el = document.querySelector('.jp-gpushare-status');
    const m = el && /using (\d+) %/.exec(el.textContent);
    return !!m && Number(m[1]) > 0;
  });
  seen.statusBusy = await page.locator('.jp-gpushare-status').innerText();
  await shot('03a-status-bar-busy');
  // the server's view now, while this kernel holds the pick (checked by test_picker.py)
  seen.afterPick = {
    sessions: await rest('/api/sessions'),
    allocations: (await rest('/gpushare/api/allocations')).allocations
  };

  // 1b. restart this notebook's kernel with a new share (palette), 1c. open the GPU dashboard
  await palette(page, 'Change the GPU Share');
  await fillPicker({ request: '0.5', limit: '1', type: 'A100' });
  await dialog.locator('.jp-Dialog-footer button', { hasText: 'Restart with new share' }).click();
  await dialog.waitFor({ state: 'detached' });
  seen.statusRestarted = await statusText(page, '50–100 %');
  seen.cellRestarted = await runCell('import os; os.environ["GPUSHARE_ALLOCATION_ID"]');
  const cellsBefore = await page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').count();
  await palette(page, 'Open the GPU Dashboard');
  const kernelBox = page.locator('#jp-gpushare-dashboard .jp-gpushare-this-kernel[data-allocation]');
  await kernelBox.waitFor();
  seen.dashboardAllocation = await kernelBox.getAttribute('data-allocation');
  seen.dashboardKernel = await kernelBox.innerText();
  seen.cellsAdded =
    (await page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').count()) - cellsBefore;
  await shot('03b-restarted-with-dashboard');

  // 2. refusals: first the picker's own check, then the server's explanation
  await page.locator('.lm-TabBar-addButton:not(.lm-mod-hidden)').first().click();
  await newNotebookFromLauncher(page, params.kernelLabel);
  await fillPicker({ request: '0.6', limit: '0.5', type: 'A100' });
  await accept();
  await picker.locator('.jp-gpushare-problem').waitFor();
  seen.clientRefusal = await picker.locator('.jp-gpushare-problem').innerText();
  await shot('04-refused-by-picker');
  await fillPicker({ request: String(params.tooBig), limit: '1', type: 'A100' });
  const refused = page.waitForResponse(
    r => r.url().includes('/gpushare/api/kernels') && r.request().method() === 'POST'
  );
  await accept();
  seen.serverAnswer = { status: (await refused).status(), body: await (await refused).json() };
  // the reopened picker says why, once, in percent (its own check agrees with the server)
  await picker.locator('.jp-gpushare-fit[data-fits="no"]').waitFor();
  seen.serverRefusal = await picker.locator('.jp-gpushare-fit').innerText();
  seen.problemBoxes = await picker.locator('.jp-gpushare-problem').count();
  await shot('05-refused-by-server');
  // "Use" next to the sentence fills in what fits; then the limit is set by hand
  await picker.locator('.jp-gpushare-fit button.jp-gpushare-use').click();
  seen.afterUse = {
    request: await picker.locator('input[name="gpu_request"]').inputValue(),
    type: await picker.locator('select[name="gpu_type"]').inputValue()
  };
  await picker.locator('input[name="gpu_limit"]').fill('0.75');
  await accept();
  await dialog.waitFor({ state: 'detached' });
  seen.status2 = await statusText(page, '50–75 %');
  await shot('06-second-kernel');

  // 3. release the second kernel's share from the command palette
  await palette(page, 'Release GPU Share');
  seen.status3 = await statusText(page, 'released');
  seen.afterRelease = (await rest('/gpushare/api/allocations')).allocations;
  seen.afterReleaseSessions = await rest('/api/sessions');
  await shot('07-released');

  // 4. cancelling the picker starts no kernel, quietly: no error dialog, no kernel chooser
  await page.locator('.lm-TabBar-addButton:not(.lm-mod-hidden)').first().click();
  await newNotebookFromLauncher(page, params.kernelLabel);
  await picker.waitFor();
  await dialog.locator('button.jp-Dialog-button.jp-mod-reject').click();
  await picker.waitFor({ state: 'detached' });
  await page.waitForTimeout(3000); // time for an error dialog or a kernel chooser to show
  seen.dialogsAfterCancel = await page.locator('.jp-Dialog').allInnerTexts();
  await shot('08-cancelled');

  // 5. Kernel › Change Kernel… to another gpushare kernelspec: the picker again. First Escape
  // in it: the running kernel stays and nothing pops up; then the change itself.
  await page.locator('.lm-TabBar-tab', { hasText: 'Untitled1.ipynb' }).click();
  const kernelOf = sessions => sessions.find(x => x.path === 'Untitled1.ipynb')?.kernel?.id;
  const before = kernelOf(await rest('/api/sessions'));
  await palette(page, 'Change Kernel');
  const chooser0 = page.locator('.jp-Dialog select');
  await chooser0.waitFor();
  await chooser0.selectOption({ label: params.otherKernelLabel });
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
  await picker.waitFor();
  await page.keyboard.press('Escape');
  await picker.waitFor({ state: 'detached' });
  await page.waitForTimeout(2000);
  seen.changeCancelled = {
    dialogs: await page.locator('.jp-Dialog').allInnerTexts(),
    kept: kernelOf(await rest('/api/sessions')) === before && !!before,
    status: await page.locator('.jp-gpushare-status').innerText()
  };
  await palette(page, 'Change Kernel');
  const chooser = page.locator('.jp-Dialog select');
  await chooser.waitFor();
  await chooser.selectOption({ label: params.otherKernelLabel });
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
  await picker.waitFor();
  seen.changeInitial = {
    request: await picker.locator('input[name="gpu_request"]').inputValue(),
    limit: await picker.locator('input[name="gpu_limit"]').inputValue()
  };
  await fillPicker({ request: '0.25', limit: '0.5', type: 'T4' });
  await shot('09-change-kernel-picker');
  await accept();
  await dialog.waitFor({ state: 'detached' });
  seen.status5 = await statusText(page, 'T4');
  await shot('10-changed-kernel');
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await shot('zz-failure').catch(() => undefined);
}
await browser.close();
console.log(JSON.stringify({ ...seen, failed }));
process.exit(failed ? 1 : 0);
