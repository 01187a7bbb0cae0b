# gpuwatch bootstrap: `gpuwatch run -- CMD` puts this file's directory first on PYTHONPATH, so every
# Python that CMD starts (itself, torchrun's workers, multiprocessing children) imports this
# `sitecustomize` at start-up. It
#   1. chains: runs the sitecustomize that would have run without us (Debian/Ubuntu ship one in
#      /usr/lib/python3.X; users may have their own on PYTHONPATH) as the real `sitecustomize`
#      module, with the errors Python's site.py would print for it;
#   2. then, only in processes started below `gpuwatch run` (GPUWATCH_RUN is set), makes the
#      `gpuwatch` package importable from the directories `gpuwatch run` names in
#      GPUWATCH_RUN_PACKAGES (the Python running the job need not have gpuwatch installed) and calls
#      gpuwatch.probes.cupti.inprocess.start_from_environment().
# Nothing here may break the program: every failure of ours is one `gpuwatch: ...` line on stderr
# (none with GPUWATCH_RUN_QUIET=1) and the program goes on.
#
# Where this lives: it is package data, read in place from the installed gpuwatch package; nothing
# is written per run, so there is no temporary directory to leak or to be raced by a symlink in
# /tmp, and it works the same for root, for ordinary users and with a read-only home.
#
# This file must parse and run on any Python a job may start, 2.7 included: no f-strings, no
# annotations, nothing newer than 2.7/3.4 outside the >= 3.10 branch. Every global is _gpuwatch_*.
import os
import sys

_GPUWATCH_MIN_PYTHON = (3, 10)


def _gpuwatch_note(msg):
    if os.environ.get("GPUWATCH_RUN_QUIET", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    try:
        sys.stderr.write("gpuwatch: %s\n" % msg)
        sys.stderr.flush()
    except Exception:
        pass


def _gpuwatch_same_dir(a, b):
    try:
        return os.path.realpath(a or os.curdir) == os.path.realpath(b or os.curdir)
    except Exception:
        return a == b


def _gpuwatch_chain(here):
    """Run the next `sitecustomize` on sys.path (ours left out) as the real `sitecustomize`."""
    me = os.path.realpath(__file__)
    paths = [p for p in sys.path if isinstance(p, str) and not _gpuwatch_same_dir(p, here)]
    if sys.version_info >= (3, 5):
        import importlib.machinery
        import importlib.util
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
        if spec is None or spec.loader is None:
            return
        if spec.origin and os.path.realpath(spec.origin) == me:
            return  # our own file through another path (a second `gpuwatch run` around this one)
        module = importlib.util.module_from_spec(spec)
        ours = sys.modules.get("sitecustomize")
        sys.modules["sitecustomize"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if ours is not None:  # as after a failed import: their half-run module is not kept
                sys.modules["sitecustomize"] = ours
            raise
        return
    import imp  # Python 2.7 and 3.0-3.4: no module_from_spec
    try:
        f, path, desc = imp.find_module("sitecustomize", paths)
    except ImportError:
        return
    try:
        if path and os.path.realpath(path) == me:
            return
        # imp runs it in the module already registered as `sitecustomize`, ours: their names join
        # our (all _gpuwatch_*) ones. Ours must stay referenced: Python 2 clears a freed module.
        ours = sys.modules.get("sitecustomize")
        our_file = getattr(ours, "__file__", None)
        try:
            imp.load_module("sitecustomize", f, path, desc)
        except BaseException:
            if ours is not None:
                ours.__file__ = our_file
                sys.modules["sitecustomize"] = ours
            raise
    finally:
        if f is not None:
            f.close()


def _gpuwatch_chain_as_site_would(here):
    # What site.execsitecustomize() does with an error in a sitecustomize: print, go on.
    try:
        try:
            _gpuwatch_chain(here)
        except ImportError as exc:
            if getattr(exc, "name", None) != "sitecustomize":
                raise
    except Exception as err:
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        elif sys.version_info[0] < 3:
            sys.stderr.write("'import sitecustomize' failed; use -v for traceback\n")
        else:
            sys.stderr.write("Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                             "%s: %s\n" % (err.__class__.__name__, err))


class _GpuwatchFinder(object):
    """Finds `gpuwatch` (a namespace) and `gpuwatch.<sub>` in the directories `gpuwatch run` named."""

    def __init__(self, dirs):
        self.dirs = dirs  # {"gpuwatch.agent": "/.../agent", ...}

    def find_spec(self, name, path=None, target=None):
        if name != "gpuwatch" and name not in self.dirs:
            return None
        import importlib.machinery
        import importlib.util
        if name == "gpuwatch":
            return importlib.machinery.ModuleSpec("gpuwatch", None, is_package=True)
        d = self.dirs[name]
        init = os.path.join(d, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[d])


def _gpuwatch_start():
    import json
    packages = json.loads(os.environ.get("GPUWATCH_RUN_PACKAGES") or "{}")
    if not isinstance(packages, dict):
        raise ValueError("GPUWATCH_RUN_PACKAGES is not a JSON object")
    dirs = dict(("gpuwatch." + k, v) for k, v in packages.items() if isinstance(v, str))
    if dirs and "gpuwatch" not in sys.modules:
        sys.meta_path.insert(0, _GpuwatchFinder(dirs))
    from gpuwatch.probes.cupti import inprocess
    inprocess.start_from_environment()


def _gpuwatch_main():
    here = os.path.dirname(os.path.abspath(__file__))
    # The program's own start-up first, exactly as without us; then the agent, in the environment
    # (sys.path, variables) that start-up left, so nothing of ours can keep theirs from running.
    _gpuwatch_chain_as_site_would(here)
    if not os.environ.get("GPUWATCH_RUN"):
        return  # on PYTHONPATH, but not below `gpuwatch run` (a copied environment): chain only
    if os.path.basename(sys.argv[0] if getattr(sys, "argv", None) else "") == "gpuwatch":
        return  # the gpuwatch CLI itself, run from inside a job: nothing to measure
    if sys.version_info < _GPUWATCH_MIN_PYTHON:
        _gpuwatch_note("the in-process agent needs Python %d.%d or newer, this is %d.%d; "
                       "running without it" % (_GPUWATCH_MIN_PYTHON + tuple(sys.version_info[:2])))
        return
    try:
        _gpuwatch_start()
    except (Exception, SystemExit) as e:
        _gpuwatch_note("in-process agent not started: %s: %s" % (e.__class__.__name__, e))


try:
    _gpuwatch_main()
except Exception as _gpuwatch_e:
    _gpuwatch_note("bootstrap failed: %s: %s" % (_gpuwatch_e.__class__.__name__, _gpuwatch_e))
