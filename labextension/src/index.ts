/**
 * jupyter-gpushare: pick a GPU share when a gpushare kernel starts, follow the start's progress,
 * see the share in the status bar and in the GPU dashboard (a side panel), release it or restart
 * with another share from the Kernel menu, the notebook toolbar or the command palette.
 *
 * How the choice reaches the provisioner: `POST /api/kernels` carries only a kernelspec name, so
 * for a kernelspec whose provisioner is `gpushare-provisioner` the extension wraps the session
 * manager's `startNew` and each session's `changeKernel`. Instead of letting the sessions API
 * start the kernel by name, it shows the picker, starts the kernel itself with
 * `POST /gpushare/api/kernels {name, path, share}` (the server passes the share to the
 * provisioner as `gpushare_share`, kept across restarts), and then creates or patches the
 * session with that kernel's id (`kernel: {id}`), which the sessions API accepts. New
 * notebooks, "Change Kernel" and "Restart with a new GPU share" all go this way.
 *
 * Cancelling the picker is quiet: a new notebook stays without a kernel (no "Error Starting
 * Kernel" dialog, no kernel chooser after it), and a kernel change keeps the running kernel.
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, Notification, SessionContext } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { IMainMenu } from '@jupyterlab/mainmenu';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelAPI, Session, SessionManager } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { CommandToolbarButton, LabIcon } from '@jupyterlab/ui-components';

import { GpushareAPI } from './api';
import { GpuDashboard } from './dashboard';
import { IStarted, pickAndStart } from './picker';
import { StartProgress } from './progress';
import { IShare } from './share';
import { GpuStatus } from './status';

export const PROVISIONER = 'gpushare-provisioner';

namespace CommandIDs {
  export const release = 'gpushare:release';
  export const dashboard = 'gpushare:open-dashboard';
  export const restart = 'gpushare:restart-with-share';
}

/** A GPU board (original drawing): the dashboard's icon in the side bar, launcher and toolbar. */
export const gpuIcon = new LabIcon({
  name: 'jupyter-gpushare:gpu',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16" height="16">' +
    '<g class="jp-icon3" fill="#616161">' +
    '<path d="M3 6h16a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2H9v2H7v-2H5v2H3zm2 2v8h14V8z"/>' +
    '<circle cx="14.5" cy="12" r="2.5"/><rect x="7" y="10" width="3" height="4"/>' +
    '</g></svg>'
});

/** The picker was cancelled: no kernel is started, and nothing is shown for it. */
class NoShareChosen extends Error {
  readonly gpushareCancelled = true;
  constructor(label: string) {
    super(`No GPU share was chosen, so no ${label} kernel was started.`);
  }
}

function isCancel(err: unknown): boolean {
  return !!err && (err as { gpushareCancelled?: boolean }).gpushareCancelled === true;
}

/**
 * Make JupyterLab's session context quiet about a cancelled pick: no "Error Starting Kernel"
 * dialog, and no kernel chooser after it (the notebook stays without a kernel; the user can pick
 * one from the Kernel menu). Other errors are shown as before.
 */
function quietCancel(): void {
  type Private = {
    _handleSessionError(err: unknown): Promise<void>;
    _handleNewSession(session: null): unknown;
    _session: unknown;
    startKernel(): Promise<boolean>;
    __gpushareCancelled?: boolean;
  };
  const proto = SessionContext.prototype as unknown as Private;
  if ((proto as { __gpusharePatched?: boolean }).__gpusharePatched) {
    return;
  }
  (proto as { __gpusharePatched?: boolean }).__gpusharePatched = true;
  const handle = proto._handleSessionError;
  proto._handleSessionError = async function (this: Private, err: unknown) {
    if (isCancel(err)) {
      this.__gpushareCancelled = true;
      if (!this._session) {
        this._handleNewSession(null); // status back from "starting" to "unknown"
      }
      return;
    }
    return handle.call(this, err);
  };
  const startKernel = proto.startKernel;
  proto.startKernel = async function (this: Private) {
    this.__gpushareCancelled = false;
    const needsChoice = await startKernel.call(this);
    return needsChoice && !this.__gpushareCancelled;
  };
}

function plugin(
  app: JupyterFrontEnd,
  tracker: INotebookTracker,
  palette: ICommandPalette | null,
  statusBar: IStatusBar | null,
  labShell: ILabShell | null,
  mainMenu: IMainMenu | null,
  launcher: ILauncher | null
): void {
  const services = app.serviceManager;
  const api = new GpushareAPI(services.serverSettings);
  const progress = new StartProgress(api);
  quietCancel();

  const specOf = (name: string) => services.kernelspecs.specs?.kernelspecs[name];
  const isGpushare = (name: string): boolean => {
    const meta = specOf(name)?.metadata as
      | { kernel_provisioner?: { provisioner_name?: string } }
      | undefined;
    return meta?.kernel_provisioner?.provisioner_name === PROVISIONER;
  };
  const labelOf = (name: string) => specOf(name)?.display_name ?? name;
  /** The share keys of a gpushare kernelspec's provisioner config (its own default share). */
  const kernelspecShare = (name: string): Partial<IShare> & { gpu_count?: number } => {
    const meta = specOf(name)?.metadata as
      | { kernel_provisioner?: { config?: Record<string, unknown> } }
      | undefined;
    const config = meta?.kernel_provisioner?.config ?? {};
    const keys = ['gpu_request', 'gpu_limit', 'gpu_memory', 'gpu_type', 'gpu_count'];
    return Object.fromEntries(
      Object.entries(config).filter(([k, v]) => keys.includes(k) && v !== null)
    ) as Partial<IShare> & { gpu_count?: number };
  };

  /** Picker + start for a kernel name, or null when it is not a gpushare kernelspec. */
  async function startWithShare(name: string, path?: string): Promise<IStarted | null> {
    await services.kernelspecs.ready;
    if (!isGpushare(name)) {
      return null;
    }
    const started = await pickAndStart(
      api,
      name,
      labelOf(name),
      path,
      kernelspecShare(name),
      progress
    );
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
      let started: IStarted | null;
      try {
        started = await startWithShare(options.name, session.path);
      } catch (err) {
        if (isCancel(err)) {
          return session.kernel; // cancelled: the running kernel stays, quietly
        }
        throw err;
      }
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

  let dashboard: GpuDashboard | null = null;
  const currentKernel = () => {
    const session = tracker.currentWidget?.sessionContext.session;
    const kernel = session?.kernel;
    return kernel && session ? { id: kernel.id, name: kernel.name, path: session.path } : null;
  };
  const openDashboard = () => {
    if (!dashboard || dashboard.isDisposed) {
      dashboard = new GpuDashboard(api, currentKernel, app.commands);
      dashboard.title.icon = gpuIcon;
      app.shell.add(dashboard, 'right', { rank: 600 });
    }
    app.shell.activateById(dashboard.id);
    dashboard.refreshSoon();
  };
  const status = new GpuStatus(api, isGpushare, progress, () => {
    void app.commands.execute(CommandIDs.dashboard);
  });
  const follow = () => {
    status.track(tracker.currentWidget?.sessionContext ?? null);
    dashboard?.refreshSoon();
    for (const id of [CommandIDs.release, CommandIDs.restart]) {
      if (app.commands.hasCommand(id)) {
        app.commands.notifyCommandChanged(id);
      }
    }
  };
  tracker.currentChanged.connect(follow);
  tracker.widgetAdded.connect((_, panel) => {
    panel.sessionContext.kernelChanged.connect(follow);
    addToolbarButtons(panel);
  });
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
    label: 'Release GPU Share (Keep the Kernel)',
    caption: 'Give this kernel’s GPU share back; the kernel keeps running without a GPU',
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
      Notification.success('Released this kernel’s GPU share; the kernel keeps running.', {
        autoClose: 5000
      });
      status.refreshSoon();
      dashboard?.refreshSoon();
    }
  });

  app.commands.addCommand(CommandIDs.restart, {
    label: 'Restart Kernel with a New GPU Share…',
    caption: 'Pick another GPU share and restart this notebook’s kernel with it',
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
        kernelspecShare(kernel.name),
        progress
      );
      if (started) {
        await session.changeKernel({ id: started.id }).catch(err => abandon(started, err));
        status.refreshSoon();
        dashboard?.refreshSoon();
      }
    }
  });

  app.commands.addCommand(CommandIDs.dashboard, {
    label: args => (args.isLauncher ? 'GPU Dashboard' : 'Open the GPU Dashboard'),
    caption: 'This kernel’s GPU share and the GPUs of this node or cluster, live',
    icon: gpuIcon,
    execute: openDashboard
  });

  function addToolbarButtons(panel: NotebookPanel): void {
    const buttons: [string, string, string][] = [
      [CommandIDs.dashboard, 'gpushare-dashboard', 'GPUs'],
      [CommandIDs.restart, 'gpushare-restart', 'New GPU share'],
      [CommandIDs.release, 'gpushare-release', 'Release GPU']
    ];
    let at = 10;
    for (const [id, name, label] of buttons) {
      const button = new CommandToolbarButton({
        commands: app.commands,
        id,
        icon: id === CommandIDs.dashboard ? gpuIcon : undefined,
        label
      });
      button.addClass(`jp-gpushare-toolbar-${name}`);
      panel.toolbar.insertItem(at++, name, button);
    }
  }

  if (mainMenu) {
    mainMenu.kernelMenu.addGroup(
      [{ command: CommandIDs.restart }, { command: CommandIDs.release }, { command: CommandIDs.dashboard }],
      50
    );
  }
  if (launcher) {
    launcher.add({ command: CommandIDs.dashboard, category: 'Other', rank: 20, args: { isLauncher: true } });
  }
  if (palette) {
    for (const command of [CommandIDs.restart, CommandIDs.release, CommandIDs.dashboard]) {
      palette.addItem({ command, category: 'GPU share' });
    }
  }
}

const extension: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-gpushare:plugin',
  description: 'GPU share picker, start progress, status-bar item, GPU dashboard and commands for gpushare kernels',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ICommandPalette, IStatusBar, ILabShell, IMainMenu, ILauncher],
  activate: plugin
};

export default extension;
