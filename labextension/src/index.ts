/**
 * jupyter-gpushare: pick a GPU share when a gpushare kernel starts, see it in the status bar,
 * release it from the command palette.
 *
 * How the choice reaches the provisioner: `POST /api/kernels` carries only a kernelspec name, so
 * for a kernelspec whose provisioner is `gpushare-provisioner` the extension wraps the session
 * manager's `startNew` and each session's `changeKernel`. Instead of letting the sessions API
 * start the kernel by name, it shows the picker, starts the kernel itself with
 * `POST /gpushare/api/kernels {name, path, share}` (the server passes the share to the
 * provisioner as `gpushare_share`, kept across restarts), and then creates or patches the
 * session with that kernel's id (`kernel: {id}`), which the sessions API accepts. New
 * notebooks, "Change Kernel" and "Restart with a new GPU share" all go this way.
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelAPI, Session, SessionManager } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';

import { GpushareAPI } from './api';
import { IStarted, pickAndStart } from './picker';
import { IShare } from './share';
import { GpuStatus } from './status';

export const PROVISIONER = 'gpushare-provisioner';

namespace CommandIDs {
  export const release = 'gpushare:release';
  export const panel = 'gpushare:open-panel';
  export const restart = 'gpushare:restart-with-share';
}

const PANEL_CODE = 'import jupyter_gpushare\njupyter_gpushare.panel()';

class NoShareChosen extends Error {
  constructor(label: string) {
    super(
      `No GPU share was chosen, so no ${label} kernel was started. ` +
        'Use Kernel › Change Kernel… to pick a share and start one.'
    );
  }
}

function plugin(
  app: JupyterFrontEnd,
  tracker: INotebookTracker,
  palette: ICommandPalette | null,
  statusBar: IStatusBar | null,
  labShell: ILabShell | null
): void {
  const services = app.serviceManager;
  const api = new GpushareAPI(services.serverSettings);

  const specOf = (name: string) => services.kernelspecs.specs?.kernelspecs[name];
  const isGpushare = (name: string): boolean => {
    const meta = specOf(name)?.metadata as
      | { kernel_provisioner?: { provisioner_name?: string } }
      | undefined;
    return meta?.kernel_provisioner?.provisioner_name === PROVISIONER;
  };
  const labelOf = (name: string) => specOf(name)?.display_name ?? name;
  /** The share keys of a gpushare kernelspec's provisioner config (its own default share). */
  const kernelspecShare = (name: string): Partial<IShare> => {
    const meta = specOf(name)?.metadata as
      | { kernel_provisioner?: { config?: Record<string, unknown> } }
      | undefined;
    const config = meta?.kernel_provisioner?.config ?? {};
    const keys = ['gpu_request', 'gpu_limit', 'gpu_memory', 'gpu_type'];
    return Object.fromEntries(
      Object.entries(config).filter(([k, v]) => keys.includes(k) && v !== null)
    ) as Partial<IShare>;
  };

  /** Picker + start for a kernel name, or null when it is not a gpushare kernelspec. */
  async function startWithShare(name: string, path?: string): Promise<IStarted | null> {
    await services.kernelspecs.ready;
    if (!isGpushare(name)) {
      return null;
    }
    const started = await pickAndStart(api, name, labelOf(name), path, kernelspecShare(name));
    if (started === null) {
      throw new NoShareChosen(labelOf(name));
    }
    return started;
  }

  /** Shut a kernel we started down again when attaching it to a session failed. */
  async function abandon(started: IStarted, err: unknown): Promise<never> {
    await KernelAPI.shutdownKernel(started.id, services.serverSettings).catch(() => undefined);
    throw err;
  }

  const patched = new WeakSet<Session.ISessionConnection>();
  function patchConnection(session: Session.ISessionConnection): void {
    if (patched.has(session)) {
      return;
    }
    patched.add(session);
    const changeKernel = session.changeKernel.bind(session);
    session.changeKernel = async (
      options: Partial<Kernel.IModel>
    ): Promise<Kernel.IKernelConnection | null> => {
      if (options.id || !options.name) {
        return changeKernel(options);
      }
      const started = await startWithShare(options.name, session.path);
      if (started === null) {
        return changeKernel(options);
      }
      return changeKernel({ id: started.id }).catch(err => abandon(started, err));
    };
  }

  const sessions = services.sessions as SessionManager;
  const startNew = sessions.startNew.bind(sessions);
  sessions.startNew = async (createOptions, connectOptions) => {
    const name = createOptions.kernel?.name;
    const started = name ? await startWithShare(name, createOptions.path) : null;
    if (started === null) {
      return startNew(createOptions, connectOptions);
    }
    const withKernel = { ...createOptions, kernel: { id: started.id } } as Session.ISessionOptions;
    return startNew(withKernel, connectOptions).catch(err => abandon(started, err));
  };
  const connectTo = sessions.connectTo.bind(sessions);
  sessions.connectTo = options => {
    const session = connectTo(options);
    patchConnection(session);
    return session;
  };

  const status = new GpuStatus(api, isGpushare);
  const follow = () => status.track(tracker.currentWidget?.sessionContext ?? null);
  tracker.currentChanged.connect(follow);
  follow();
  if (statusBar) {
    statusBar.registerStatusItem('jupyter-gpushare:status', {
      item: status,
      align: 'left',
      rank: 4,
      isActive: () => !!tracker.currentWidget && labShell?.currentWidget === tracker.currentWidget
    });
  }

  const current = (): NotebookPanel | null => tracker.currentWidget;
  const hasGpushareKernel = () => {
    const kernel = current()?.sessionContext.session?.kernel;
    return !!kernel && isGpushare(kernel.name);
  };

  app.commands.addCommand(CommandIDs.release, {
    label: 'GPU: Release this kernel’s GPU share (keep the kernel)',
    isEnabled: hasGpushareKernel,
    execute: async () => {
      const kernel = current()?.sessionContext.session?.kernel;
      if (!kernel) {
        return;
      }
      const allocations = await api.allocations();
      const mine = allocations.find(a => a.kernel_id === kernel.id);
      if (!mine) {
        Notification.info('This kernel holds no GPU share.', { autoClose: 5000 });
        return;
      }
      await api.release(mine.id);
      Notification.success(`Released GPU share ${mine.id}; the kernel keeps running.`, {
        autoClose: 5000
      });
      status.refreshSoon();
    }
  });

  app.commands.addCommand(CommandIDs.restart, {
    label: 'GPU: Restart kernel with a new GPU share…',
    isEnabled: hasGpushareKernel,
    execute: async () => {
      const session = current()?.sessionContext.session;
      const kernel = session?.kernel;
      if (!session || !kernel) {
        return;
      }
      // The new kernel starts (and is placed) before the old one stops, so a refused pick
      // leaves the running kernel alone; the sessions API shuts the old kernel down.
      const started = await pickAndStart(
        api,
        kernel.name,
        labelOf(kernel.name),
        session.path,
        kernelspecShare(kernel.name)
      );
      if (started) {
        await session.changeKernel({ id: started.id }).catch(err => abandon(started, err));
        status.refreshSoon();
      }
    }
  });

  app.commands.addCommand(CommandIDs.panel, {
    label: 'GPU: Open the GPU panel in this notebook',
    isEnabled: hasGpushareKernel,
    execute: async () => {
      const panel = current();
      if (!panel) {
        return;
      }
      const notebook = panel.content;
      const active = notebook.activeCell;
      if (!active || active.model.type !== 'code' || active.model.sharedModel.getSource()) {
        NotebookActions.insertBelow(notebook); // keep the user's cells; reuse an empty one
      }
      const cell = notebook.activeCell;
      if (cell) {
        cell.model.sharedModel.setSource(PANEL_CODE);
        await NotebookActions.run(notebook, panel.sessionContext);
      }
    }
  });

  if (palette) {
    for (const command of [CommandIDs.restart, CommandIDs.release, CommandIDs.panel]) {
      palette.addItem({ command, category: 'GPU share' });
    }
  }
}

const extension: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpushare:plugin',
  description: 'GPU share picker, status-bar item and commands for gpushare kernels',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, IStatusBar, ILabShell],
  activate: plugin
};

export default extension;
