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
import { DashboardArea, GpuDashboard } from './dashboard';
import { IStarted, pickAndChange, pickAndStart } from './picker';
import { StartProgress } from './progress';
import { formatRange, IShare } from './share';
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
 *
 * The context stays as a notebook with "No Kernel" is: not ready (`sessionContext.ready` resolves
 * once a kernel is started later). Lab would mark it ready with no session, and extensions that
 * await `ready` and then read `session.kernel` (ipywidgets' manager) failed with "Cannot read
 * properties of null (reading 'kernel')".
 */
function quietCancel(): void {
  type Delegate = { promise: Promise<void>; resolve(value: void): void };
  type Private = {
    _handleSessionError(err: unknown): Promise<void>;
    _statusChanged: { emit(status: string): void };
    _kernelChanged: { emit(change: { name: string; oldValue: null; newValue: null }): void };
    _pendingKernelName: string;
    noKernelName: string;
    _ready: Delegate;
    _isReady: boolean;
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
      // as a notebook whose kernel was shut down: "No Kernel", status back from "starting"
      this._pendingKernelName = this.noKernelName;
      this._kernelChanged.emit({ name: 'kernel', oldValue: null, newValue: null });
      this._statusChanged.emit('unknown');
      return;
    }
    return handle.call(this, err);
  };
  const startKernel = proto.startKernel;
  proto.startKernel = async function (this: Private) {
    this.__gpushareCancelled = false;
    const needsChoice = await startKernel.call(this);
    if (!this.__gpushareCancelled) {
      return needsChoice;
    }
    // `initialize` marks the context ready when no choice is needed: keep it as it was
    const real = this._ready;
    const wasReady = this._isReady;
    this._ready = {
      promise: real.promise,
      resolve: () => {
        this._ready = real;
        if (this._session) {
          real.resolve(); // a kernel was started since: ready now
        } else {
          this._isReady = wasReady;
        }
      }
    };
    return false;
  };
}

/**
 * The notebook a new session is for. JupyterLab creates a session under a temporary path (a
 * UUID in the notebook's directory) with the notebook's file name as the session's name, and
 * renames it afterwards; jupyter_server gives a kernel it starts for a session the directory
 * joined with that name (`JPY_SESSION_NAME`). The same here, for the share's record.
 */
export function notebookPath(options: { path?: string; name?: string }): string | undefined {
  const { path, name } = options;
  if (!path || !name) {
    return path;
  }
  const slash = path.lastIndexOf('/');
  return slash < 0 ? name : `${path.slice(0, slash + 1)}${name}`;
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
    const started = name ? await startWithShare(name, notebookPath(createOptions)) : null;
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

  /** The dashboards: one in the right side bar, one in the main area (wide), each opened on
   * demand. */
  const dashboards = new Map<DashboardArea, GpuDashboard>();
  const dashboard = {
    refreshSoon: () => dashboards.forEach(d => d.isDisposed || d.refreshSoon())
  };
  const currentKernel = () => {
    const session = tracker.currentWidget?.sessionContext.session;
    const kernel = session?.kernel;
    return kernel && session ? { id: kernel.id, name: kernel.name, path: session.path } : null;
  };
  const openDashboard = (area: DashboardArea) => {
    let widget = dashboards.get(area);
    if (!widget || widget.isDisposed) {
      widget = new GpuDashboard(api, currentKernel, app.commands, area);
      widget.title.icon = gpuIcon;
      dashboards.set(area, widget);
      if (area === 'main') {
        widget.title.closable = true;
        app.shell.add(widget, 'main');
      } else {
        app.shell.add(widget, 'right', { rank: 600 });
      }
    }
    app.shell.activateById(widget.id);
    widget.refreshSoon();
  };
  const status = new GpuStatus(api, isGpushare, progress, () => {
    void app.commands.execute(CommandIDs.dashboard);
  });
  // Release is enabled while the current kernel holds a share (the status bar's reading)
  status.allocationChanged.connect(() => {
    for (const id of [CommandIDs.release, CommandIDs.restart]) {
      app.commands.notifyCommandChanged(id);
    }
  });
  const follow = () => {
    status.track(tracker.currentWidget?.sessionContext ?? null);
    dashboard.refreshSoon();
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

  /** The current kernel's share as the status bar last read it (null: none, or released). */
  const heldShare = () => {
    const kernel = current()?.sessionContext.session?.kernel;
    const held = status.allocation;
    return kernel && held && held.kernel_id === kernel.id ? held : null;
  };

  app.commands.addCommand(CommandIDs.release, {
    label: 'Release GPU Share (Keep the Kernel)',
    caption: 'Give this kernel’s GPU share back; the kernel keeps running without a GPU',
    isEnabled: () => hasGpushareKernel() && heldShare() !== null,
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
      status.allocation = null; // no second Release while the status bar reads again
      app.commands.notifyCommandChanged(CommandIDs.release);
      Notification.success('Released this kernel’s GPU share; the kernel keeps running.', {
        autoClose: 5000
      });
      status.refreshSoon();
      dashboard.refreshSoon();
    }
  });

  app.commands.addCommand(CommandIDs.restart, {
    label: 'Change the GPU Share (Live, or Restart the Kernel)…',
    caption:
      'Pick another GPU share for this notebook’s kernel: changed live where it fits on the ' +
      'kernel’s GPU, else the kernel restarts with it (its state is lost; the dialog says so)',
    isEnabled: hasGpushareKernel,
    execute: async () => {
      const session = current()?.sessionContext.session;
      const kernel = session?.kernel;
      if (!session || !kernel) {
        return;
      }
      const held = (await api.allocations()).find(a => a.kernel_id === kernel.id) ?? null;
      // A restart starts (and places) the new kernel before the old one stops, so a refused
      // pick leaves the running kernel alone; the sessions API shuts the old kernel down.
      const done = await pickAndChange(
        api,
        kernel.name,
        labelOf(kernel.name),
        session.path,
        held,
        kernelspecShare(kernel.name),
        progress
      );
      if (done?.kind === 'restart') {
        const started = done.started;
        await session.changeKernel({ id: started.id }).catch(err => abandon(started, err));
      } else if (done?.kind === 'live') {
        const range = formatRange(done.allocation.gpu_request, done.allocation.gpu_limit);
        Notification.success(`This kernel’s GPU share is now ${range}; it kept running.`, {
          autoClose: 5000
        });
      }
      if (done) {
        status.refreshSoon();
        dashboard.refreshSoon();
      }
    }
  });

  app.commands.addCommand(CommandIDs.dashboard, {
    label: args =>
      args.isLauncher
        ? 'GPU Dashboard'
        : args.area === 'main'
          ? 'Open the GPU Dashboard in the Main Area'
          : 'Open the GPU Dashboard',
    caption: 'This kernel’s GPU share and the GPUs of this node or cluster, live',
    icon: gpuIcon,
    execute: args => openDashboard(args.area === 'main' ? 'main' : 'right')
  });

  function addToolbarButtons(panel: NotebookPanel): void {
    const buttons: [string, string, string][] = [
      [CommandIDs.dashboard, 'gpushare-dashboard', 'GPUs'],
      [CommandIDs.restart, 'gpushare-restart', 'Change GPU share'],
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
    launcher.add({
      command: CommandIDs.dashboard,
      category: 'Other',
      rank: 20,
      args: { isLauncher: true, area: 'main' }
    });
  }
  if (palette) {
    for (const command of [CommandIDs.restart, CommandIDs.release, CommandIDs.dashboard]) {
      palette.addItem({ command, category: 'GPU share' });
    }
    palette.addItem({ command: CommandIDs.dashboard, category: 'GPU share', args: { area: 'main' } });
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
