// Browser driver for test_share_flow.py (issue 24): one JupyterLab on one simulated A100, driven
// through what a new user does, in order. Each step records what a test of test_share_flow.py
// checks; screenshots go to $ARTIFACTS; the last stdout line is a JSON object of what was seen.
//
//  13. Cancel in the picker of a new notebook: no error in the browser console.
//   5. The picker checks each field as it is typed, in the field's words, without moving.
//  11. An empty limit follows the one default-limit rule (the picker says 30–50 % for 0.3).
//   2. Notebook A ("gpuwork_loop_benchmark_run.ipynb") starts 50–100 % from the picker; its share
//      records the notebook.
//   1. "Change the GPU Share": the dialog says a restart loses the kernel's state, names its
//      buttons, and changes live (75–100 %) where it fits: same kernel, same variables.
//   4. Notebook B asks 50 % of an A100 with 25 % free: the picker says so before Start, in
//      percent, once; "Use" (a button) sets request and limit (25–50 %); the kernel gets that.
//   8. The dashboard in the side bar and in the main area: headers, file names, the reserved
//      line at 100 %, one legend style with the notebook panel.
//   7. Release A: Release is disabled for A afterwards.
//   3. The GPU's history keeps A's use after the release.
//   6. A's refused GPU calls explain themselves in each cell's output.
import { chromium } from 'playwright-core';
import { GPU_SETUP, newNotebookFromLauncher, openPage, palette, statusText } from './labpage.mjs';

const { LAB_URL, LAB_TOKEN, ARTIFACTS, CHROMIUM } = process.env;
const params = JSON.parse(process.env.PARAMS || '{}');
const seen = { consoleErrors: [] };
const NOTEBOOK_A = 'gpuwork_loop_benchmark_run.ipynb';

// GPU work that stops at its first refused launch (after the release)
const GPU_WORK = `${GPU_SETUP}
def launch():
    return cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, params, None)
def spin():
    cu.cuCtxSetCurrent(ctx)
    while launch() == 0:
        cu.cuCtxSynchronize()
threading.Thread(target=spin, daemon=True).start()
marker = 42
"busy"`;

const { browser, page } = await openPage(chromium, CHROMIUM, { width: 1400, height: 900 });
page.setDefaultTimeout(20000);
page.on('console', msg => {
  if (msg.type() === 'error' || msg.type() === 'warning') {
    console.error(`[browser ${msg.type()}] ${msg.text()}`);
  }
  if (msg.type() === 'error') {
    seen.consoleErrors.push(msg.text());
  }
});
page.on('pageerror', err => {
  console.error(`[page error] ${err.stack || err}`);
  seen.consoleErrors.push(String(err.stack || err));
});
const rest = async (path, init = {}) => {
  const response = await fetch(`${LAB_URL}${path}`, {
    ...init,
    headers: { Authorization: `token ${LAB_TOKEN}`, 'Content-Type': 'application/json' }
  });
  const text = await response.text();
  return text ? JSON.parse(text) : null;
};
const shot = name => page.screenshot({ path: `${ARTIFACTS}/${name}.png` });
const dialog = page.locator('.jp-Dialog');
const picker = dialog.locator('.jp-gpushare-picker');
const visiblePanel = '.jp-NotebookPanel:not(.lm-mod-hidden)';
/** innerText of the first match, or null when there is none (no waiting) */
const textOf = selector =>
  page.evaluate(sel => {
    const el = document.querySelector(sel);
    return el ? el.innerText : null;
  }, selector);

async function fillPicker({ request, limit, memory, type }) {
  await picker.waitFor();
  if (request !== undefined) await picker.locator('input[name="gpu_request"]').fill(request);
  if (limit !== undefined) await picker.locator('input[name="gpu_limit"]').fill(limit);
  if (memory !== undefined) await picker.locator('input[name="gpu_memory"]').fill(memory);
  if (type !== undefined) await picker.locator('select[name="gpu_type"]').selectOption(type);
}

/** Run `code` in the visible notebook's last cell; the outputs once `want` shows (or 10 s). */
async function runCell(code, want = null) {
  const cells = page.locator(`${visiblePanel} .jp-Cell`);
  const index = (await cells.count()) - 1;
  const cell = cells.nth(index);
  await cell.locator('.cm-content').click();
  await page.keyboard.insertText(code);
  await page.keyboard.press('Shift+Enter');
  const output = cell.locator('.jp-OutputArea-output');
  await output.first().waitFor();
  if (want) {
    await page
      .waitForFunction(
        ([sel, i, w]) => {
          const c = document.querySelectorAll(sel)[i];
          return !!c && c.innerText.includes(w);
        },
        [`${visiblePanel} .jp-Cell`, index, want],
        { timeout: 10000 }
      )
      .catch(() => undefined);
  }
  return (await output.allInnerTexts()).join('\n');
}

const dialogBox = async () => {
  const box = await page.locator('.jp-Dialog-content').boundingBox();
  return box && { x: Math.round(box.x), y: Math.round(box.y), width: Math.round(box.width), height: Math.round(box.height) };
};

let failed = null;
const stepErrors = {};
/** One item's steps: a failure is recorded (and its dialogs closed), and the next step runs. */
async function step(name, fn) {
  try {
    await fn();
  } catch (err) {
    stepErrors[name] = String(err && err.stack ? err.stack : err).slice(0, 1500);
    await shot(`zz-failure-${name}`).catch(() => undefined);
    for (let i = 0; i < 3; i++) {  // the palette or a dialog left open
      await page.keyboard.press('Escape');
      await page.waitForTimeout(300);
    }
  }
}
try {
  // a notebook with a long file name, for the dashboard's rows and the share's record
  await rest(`/api/contents/${NOTEBOOK_A}`, {
    method: 'PUT',
    body: JSON.stringify({
      type: 'notebook',
      format: 'json',
      content: {
        cells: [],
        metadata: {
          kernelspec: { name: params.kernelName, display_name: params.kernelLabel, language: 'python' }
        },
        nbformat: 4,
        nbformat_minor: 5
      }
    })
  });
  await page.goto(`${LAB_URL}/lab?reset&token=${LAB_TOKEN}`);
  await page.locator('.jp-LauncherCard').first().waitFor({ timeout: 90000 });

  await step('13', async () => {
    // 13. Cancel in the picker of a new notebook: no console error
    await newNotebookFromLauncher(page, params.kernelLabel);
    await picker.waitFor();
    await page.waitForTimeout(500);
    const errorsBefore = seen.consoleErrors.length;
    await dialog.locator('button.jp-Dialog-button.jp-mod-reject').click();
    await picker.waitFor({ state: 'detached' });
    await page.waitForTimeout(3000);
    seen.cancelErrors = seen.consoleErrors.slice(errorsBefore);
    seen.dialogsAfterCancel = await page.locator('.jp-Dialog').allInnerTexts();
    await shot('13-picker-cancelled');

  });
  await step('5', async () => {
    // 5. notebook A: its picker checks the fields as they are typed
    await page.locator('.jp-DirListing-item', { hasText: NOTEBOOK_A }).dblclick();
    await picker.waitFor();
    await page.waitForTimeout(300);
    seen.startButtons = await dialog.locator('.jp-Dialog-footer button').allInnerTexts();
    await shot('02-picker');
    const boxes = [await dialogBox()];
    const request = picker.locator('input[name="gpu_request"]');
    await request.fill('');
    await request.pressSequentially('0.333', { delay: 40 });
    seen.requestError = await textOf('.jp-gpushare-picker label[data-field="gpu_request"] .jp-gpushare-field-error');
    boxes.push(await dialogBox());
    await picker.locator('input[name="gpu_memory"]').pressSequentially('lots', { delay: 40 });
    seen.memoryError = await textOf('.jp-gpushare-picker label[data-field="gpu_memory"] .jp-gpushare-field-error');
    boxes.push(await dialogBox());
    await shot('05-picker-live-checks');
    seen.pickerBoxes = boxes;

  });
  await step('11', async () => {
    // 11. an empty limit: the larger of the request and the default share's limit
    await fillPicker({ request: '0.3', limit: '', memory: '', type: 'A100' });
    seen.summaryDefaultLimit = await textOf('.jp-gpushare-picker .jp-gpushare-summary');
    seen.limitPlaceholder = await picker.locator('input[name="gpu_limit"]').getAttribute('placeholder');

  });
  await step('2', async () => {
    // 2. start A with 50–100 %
    await fillPicker({ request: '0.5', limit: '1', memory: '', type: 'A100' });
    seen.fitA = await textOf('.jp-gpushare-picker .jp-gpushare-fit');
    await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
    await dialog.waitFor({ state: 'detached' });
    seen.statusA = await statusText(page, '50–100 %');
    await runCell(GPU_WORK);
    await page.waitForFunction(() => {
      const el = document.querySelector('.jp-gpushare-status');
      const m = el && /using (\d+) %/.exec(el.textContent);
      return !!m && Number(m[1]) > 0;
    });
    const sessions = await rest('/api/sessions');
    seen.kernelA = sessions.find(s => s.path === NOTEBOOK_A)?.kernel?.id ?? null;
    seen.allocationA = (await rest('/gpushare/api/allocations')).allocations.find(
      a => a.kernel_id === seen.kernelA
    );

  });
  await step('1', async () => {
    // 1. change the share: the dialog says what a restart costs; a live change where it fits
    await palette(page, 'Change the GPU Share');
    await picker.waitFor();
    await fillPicker({ request: '0.75', limit: '1', memory: '' });
    await page.waitForSelector('.jp-gpushare-live-note[data-live="yes"]', { timeout: 10000 }).catch(() => undefined);
    seen.changeDialog = {
      title: await textOf('.jp-Dialog-header'),
      text: await textOf('.jp-Dialog-content'),
      buttons: await dialog.locator('.jp-Dialog-footer button').allInnerTexts()
    };
    await shot('01-change-share-dialog');
    await dialog.locator('.jp-Dialog-footer button', { hasText: 'Change live' }).click();
    await dialog.waitFor({ state: 'detached' });
    seen.statusLive = await statusText(page, '75–100 %');
    seen.kernelAfterLive = (await rest('/api/sessions')).find(s => s.path === NOTEBOOK_A)?.kernel?.id;
    seen.markerAfterLive = await runCell('print(marker)', '42');
    // a share that does not fit on the kernel's GPU: only a restart, and the dialog says so
    await palette(page, 'Change the GPU Share');
    await picker.waitFor();
    await fillPicker({ memory: '200GiB' });
    seen.restartOnly = {
      note: await textOf('.jp-gpushare-live-note'),
      liveDisabled: await dialog.locator('.jp-Dialog-footer button', { hasText: 'Change live' }).isDisabled(),
      restartButton: await dialog.locator('.jp-Dialog-footer button', { hasText: 'Restart with new share' }).count()
    };
    await shot('01b-change-share-restart-only');
    await dialog.locator('button.jp-Dialog-button.jp-mod-reject').click();
    await dialog.waitFor({ state: 'detached' });

  });
  await step('4', async () => {
    // 4. notebook B asks more than is free: the picker says it before Start
    await page.locator('.lm-TabBar-addButton:not(.lm-mod-hidden)').first().click();
    await newNotebookFromLauncher(page, params.kernelLabel);
    await fillPicker({ request: '0.5', limit: '1', memory: '', type: 'A100' });
    await page.waitForSelector('.jp-gpushare-fit[data-fits="no"]', { timeout: 10000 }).catch(() => undefined);
    seen.fitB = await textOf('.jp-gpushare-picker .jp-gpushare-fit');
    seen.pickerTextB = await textOf('.jp-gpushare-picker');
    seen.useButton = await page.evaluate(() => {
      const b = document.querySelector('.jp-gpushare-fit button.jp-gpushare-use');
      if (!b) {
        return null;
      }
      const s = getComputedStyle(b);
      const parent = getComputedStyle(b.parentElement);
      return {
        text: b.innerText,
        tag: b.tagName,
        cursor: s.cursor,
        border: s.borderTopWidth,
        borderStyle: s.borderTopStyle,
        background: s.backgroundColor,
        parentBackground: parent.backgroundColor,
        padding: s.paddingLeft
      };
    });
    await shot('04-picker-does-not-fit');
    await picker.locator('.jp-gpushare-fit button.jp-gpushare-use').click();
    seen.afterUse = {
      request: await picker.locator('input[name="gpu_request"]').inputValue(),
      limit: await picker.locator('input[name="gpu_limit"]').inputValue(),
      summary: await textOf('.jp-gpushare-picker .jp-gpushare-summary'),
      fit: await textOf('.jp-gpushare-picker .jp-gpushare-fit')
    };
    await shot('04b-picker-after-use');
    await dialog.locator('button.jp-Dialog-button.jp-mod-accept').click();
    await dialog.waitFor({ state: 'detached' });
    seen.statusB = await statusText(page, '25–50 %');

  });
  await step('8', async () => {
    // 8. the notebook panel and the dashboard: one legend style; headers, names, reserved line
    await runCell('import jupyter_gpushare\njupyter_gpushare.panel()');
    await page.waitForSelector(`${visiblePanel} .gpushare-panel svg line[data-series="limit"]`, { state: 'attached', timeout: 30000 });
    await palette(page, 'Open the GPU Dashboard');
    const side = '#jp-gpushare-dashboard';
    await page.waitForSelector(`${side} .jp-gpushare-this-kernel .jp-gpushare-rule.jp-mod-limit`, { state: 'attached' });
    await page.waitForSelector(`${side} .jp-gpushare-gpu polyline`, { state: 'attached', timeout: 30000 });
    seen.legend = await page.evaluate(([panelSel, sideSel]) => {
      const style = el => {
        if (!el) return null;
        const s = getComputedStyle(el);
        return { stroke: s.stroke, dash: s.strokeDasharray };
      };
      const panelLegend = [...document.querySelectorAll(`${panelSel} .gpushare-legend svg line`)];
      return {
        panel: {
          request: style(document.querySelector(`${panelSel} svg line[data-series="request"]`)),
          limit: style(document.querySelector(`${panelSel} svg line[data-series="limit"]`)),
          requestLegend: style(panelLegend[2]),
          limitLegend: style(panelLegend[3])
        },
        dashboard: {
          request: style(document.querySelector(`${sideSel} .jp-gpushare-this-kernel svg:not(.jp-gpushare-swatch) .jp-mod-request`)),
          limit: style(document.querySelector(`${sideSel} .jp-gpushare-this-kernel svg:not(.jp-gpushare-swatch) .jp-mod-limit`)),
          requestLegend: style(document.querySelector(`${sideSel} .jp-gpushare-legend .jp-mod-request`)),
          limitLegend: style(document.querySelector(`${sideSel} .jp-gpushare-legend .jp-mod-limit`))
        }
      };
    }, [`${visiblePanel} .gpushare-panel`, side]);
    seen.sideLayout = await page.evaluate(sel => {
      // the lines its text is laid out on (distinct tops of the text's boxes)
      const lines = el => {
        const range = document.createRange();
        range.selectNodeContents(el);
        return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
      };
      const board = document.querySelector(sel);
      const chart = board.querySelector('.jp-gpushare-gpu svg');
      const reserved = chart.querySelector('.jp-mod-reserved');
      const polylines = [...chart.querySelectorAll('polyline')];
      return {
        width: Math.round(board.getBoundingClientRect().width),
        headers: [...board.querySelectorAll('.jp-gpushare-shares th')].map(th => ({ text: th.innerText, lines: lines(th) })),
        names: [...board.querySelectorAll('.jp-gpushare-shares td:first-child > div:nth-child(2)')].map(d => ({
          text: d.innerText,
          title: d.title,
          lines: lines(d)
        })),
        reservedLabel: [...board.querySelectorAll('.jp-gpushare-gpu .jp-gpushare-legend')].map(l => l.innerText).join(' '),
        reservedDrawnOverUse:
          !!reserved && polylines.length > 0 && polylines.every(p => !!(p.compareDocumentPosition(reserved) & Node.DOCUMENT_POSITION_FOLLOWING)),
        reservedY: reserved ? Number(reserved.getAttribute('y1')) : null,
        reservedStroke: reserved ? getComputedStyle(reserved).strokeDasharray : null
      };
    }, side);
    await shot('08-dashboard-side-and-panel');
    await palette(page, 'Open the GPU Dashboard in the Main Area');
    const main = '#jp-gpushare-dashboard-main';
    await page.waitForSelector(`${main} .jp-gpushare-gpu`, { timeout: 15000 }).catch(() => undefined);
    seen.mainDashboard = await page.evaluate(sel => {
      const board = document.querySelector(sel);
      if (!board) return null;
      return {
        width: Math.round(board.getBoundingClientRect().width),
        wide: board.classList.contains('jp-mod-wide'),
        inMain: !!board.closest('#jp-main-dock-panel'),
        gpus: board.querySelectorAll('.jp-gpushare-gpu').length
      };
    }, main);
    await shot('08-dashboard-main-area');

  });
  await step('7', async () => {
    // 7. release A: Release is disabled for A afterwards
    await page.locator('.lm-TabBar-tab', { hasText: NOTEBOOK_A }).first().click();
    await page.waitForTimeout(1000);
    await palette(page, 'Release GPU Share');
    seen.statusReleased = await statusText(page, 'released');
    const releaseDisabled = () =>
      page.evaluate(sel => {
        const item = document.querySelector(`${sel} .jp-gpushare-toolbar-gpushare-release`);
        if (!item) return null;
        const nodes = [item, ...item.querySelectorAll('*')];
        return nodes.some(
          n => n.hasAttribute('disabled') || n.getAttribute('aria-disabled') === 'true' ||
            n.classList.contains('lm-mod-disabled') || n.classList.contains('jp-mod-disabled')
        );
      }, visiblePanel);
    await page.waitForFunction(
      sel => {
        const item = document.querySelector(`${sel} .jp-gpushare-toolbar-gpushare-release`);
        return !!item && [item, ...item.querySelectorAll('*')].some(
          n => n.hasAttribute('disabled') || n.getAttribute('aria-disabled') === 'true' ||
            n.classList.contains('lm-mod-disabled') || n.classList.contains('jp-mod-disabled')
        );
      },
      visiblePanel,
      { timeout: 10000 }
    ).catch(() => undefined);
    seen.releaseToolbarDisabled = await releaseDisabled();
    await page.keyboard.press('Control+Shift+C');
    await page.locator('.lm-CommandPalette-input').fill('Release GPU Share');
    seen.releasePaletteClass = await page
      .locator('.lm-CommandPalette-item', { hasText: 'Release GPU Share' })
      .first()
      .getAttribute('class');
    await shot('07-release-disabled-after-release');
    await page.keyboard.press('Escape');

  });
  await step('3', async () => {
    // 3. the GPU's history keeps A's use after its release
    await page.waitForTimeout(2500);
    const board = await rest('/gpushare/api/dashboard');
    seen.historyAfterRelease = board.gpus.map(g => board.history.gpus[g.uuid] ?? []);
    seen.allocationsAfterRelease = (await rest('/gpushare/api/allocations')).allocations;
    await shot('03-dashboard-history-after-release');

  });
  await step('6', async () => {
    // 6. A's refused GPU calls explain themselves, each cell's output (a thread's too)
    seen.refused1 = await runCell('print(launch())', 'gpushare');
    seen.refused2 = await runCell(
      'res = []\nt = threading.Thread(target=lambda: res.append(launch()))\nt.start(); t.join(); print(res)',
      'gpushare'
    );
    await shot('06-refused-calls-explained');
  });
} catch (err) {
  failed = String(err && err.stack ? err.stack : err);
  await shot('zz-failure').catch(() => undefined);
}
await browser.close();
if (!failed && Object.keys(stepErrors).length) {
  failed = `steps failed: ${JSON.stringify(stepErrors)}`;
}
console.log(JSON.stringify({ ...seen, stepErrors, failed }));
process.exit(failed ? 1 : 0);
