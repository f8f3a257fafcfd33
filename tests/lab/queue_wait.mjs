// Browser driver for test_queue_wait.py: waiting in line from JupyterLab's picker (issue 27), in
// Debian's headless Chromium. The one A100 is held whole by another Unix user (gsalice, through
// the system node agent); this Lab's user:
//
// 1. New notebook -> the picker: 0.5 of an A100 does not fit; "Wait in line" is offered and
//    chosen; Start -> the waiting dialog shows the place in line and the ETA; "Cancel waiting"
//    removes the queue entry (the server's queue is empty after it) and starts no kernel.
// 2. A second notebook, the same pick and wait; while it waits the driver writes
//    $ARTIFACTS/release-now, on which the test has alice release her share; the kernel starts
//    by itself, a notification says so, and a cell runs in it.
// Screenshots go to $ARTIFACTS; the last stdout line is a JSON object of what was seen.
import { writeFileSync } from 'node:fs';
import { chromium } from 'playwright-core';
import { newNotebookFromLauncher, openPage } from './labpage.mjs';

const { LAB_URL, LAB_TOKEN, ARTIFACTS, CHROMIUM } = process.env;
const params = JSON.parse(process.env.PARAMS || '{}');
const seen = {};

const { browser, page } = await openPage(chromium, CHROMIUM, { width: 1400, height: 900 });
page.setDefaultTimeout(30000);
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
const waiting = page.locator('.jp-gpushare-waiting-dialog');
const waitLine = waiting.locator('.jp-gpushare-waiting-line[data-state="waiting"]');

async function pickAndWait() {
  await picker.waitFor();
  await picker.locator('input[name="gpu_request"]').fill('0.5');
  await picker.locator('input[name="gpu_limit"]').fill('0.5');
  await picker.locator('select[name="gpu_type"]').selectOption('A100');
  await picker.locator('.jp-gpushare-fit[data-fits="no"]').waitFor();
  await picker.locator('input[name="gpushare_wait"]').check();
  const fit = await picker.locator('.jp-gpushare-fit').innerText();
  await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
  await waitLine.waitFor();
  return fit;
}

let failed = null;
try {
  await page.goto(`${LAB_URL}/lab?reset&token=${LAB_TOKEN}`);
  await page.locator('.jp-LauncherCard').first().waitFor({ timeout: 90000 });

  // 1. wait in line, then cancel
  await newNotebookFromLauncher(page, params.kernelLabel);
  await picker.waitFor();
  await picker.locator('input[name="gpu_request"]').fill('0.5');
  await picker.locator('input[name="gpu_limit"]').fill('0.5');
  await picker.locator('select[name="gpu_type"]').selectOption('A100');
  await picker.locator('input[name="gpushare_wait"]').waitFor();
  await shot('01-picker-offers-to-wait');
  seen.fit1 = await pickAndWait();
  seen.waiting1 = await waitLine.innerText();
  seen.queue1 = await rest('/gpushare/api/queue');
  await shot('02-waiting-position-and-eta');
  await waiting.locator('button', { hasText: 'Cancel waiting' }).click();
  await page.locator('.Toastify__toast', { hasText: 'Cancelled' }).first().waitFor();
  await page.waitForTimeout(1000); // an error dialog or a kernel chooser would show by now
  seen.dialogsAfterCancel = await page.locator('.jp-Dialog').allInnerTexts();
  seen.queueAfterCancel = await rest('/gpushare/api/queue');
  seen.kernelsAfterCancel = await rest('/api/kernels');
  await shot('03-cancelled');

  // 2. wait again; alice releases; the kernel starts by itself
  await page.locator('.lm-TabBar-addButton:not(.lm-mod-hidden)').first().click();
  await newNotebookFromLauncher(page, params.kernelLabel);
  seen.fit2 = await pickAndWait();
  // the line is updated live: the ETA's words as the server recomputes them
  seen.waiting2 = await waitLine.innerText();
  writeFileSync(`${ARTIFACTS}/release-now`, String(Date.now() / 1000));
  const toast = page.locator('.Toastify__toast', { hasText: 'started by itself' }).first();
  await toast.waitFor({ timeout: 30000 });
  seen.startedAt = Date.now() / 1000;
  seen.notice = await toast.innerText();
  await page.waitForTimeout(800); // the toast's slide-in, for the screenshot
  await shot('04-started-by-itself');
  seen.dialogsAfterStart = await page.locator('.jp-Dialog').allInnerTexts();
  const cells = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell');
  const cell = cells.nth((await cells.count()) - 1); // fixed index: Shift+Enter adds a cell
  await cell.locator('.cm-content').click();
  await page.keyboard.insertText('import os; os.environ["GPUSHARE_ALLOCATION_ID"]');
  await page.keyboard.press('Shift+Enter');
  const output = cell.locator('.jp-OutputArea-output').first();
  await output.waitFor({ timeout: 30000 });
  seen.cell = await output.innerText();
  seen.allocations = (await rest('/gpushare/api/allocations')).allocations;
  seen.queueAfterStart = await rest('/gpushare/api/queue');
  await shot('05-kernel-runs');
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await shot('zz-failure').catch(() => undefined);
}
await browser.close();
console.log(JSON.stringify({ ...seen, failed }));
process.exit(failed ? 1 : 0);
