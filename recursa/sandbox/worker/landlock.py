"""Landlock: the filesystem, TCP and signal rules that confine a worker to its scratch folder."""

from __future__ import annotations

import ctypes
import os
import stat
import sys

from .syscalls import SYSCALLS, Report, errno_text, libc_handle

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_BLOCK = 1 << 11
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1 << 0
_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8

# Folders whose *files* stay unreadable unless the user allows them (their names can be listed when
# a parent has to be listed, e.g. the stdlib folder that holds site-packages).
_PACKAGE_DIRS = ("site-packages", "dist-packages")

# Read-only system paths Python may need after start: shared libraries for extension modules loaded
# later (dlopen), time zones, the CPU count. Missing ones are skipped.
_SYSTEM_READ = (
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/usr/share/zoneinfo",
    "/sys/devices/system/cpu",
    "/dev/urandom",
    "/dev/zero",
)


def kernel_abi(libc: Any, sysnr: dict[str, int]) -> int:
    abi = libc.syscall(
        ctypes.c_long(sysnr["ll_create"]), ctypes.c_void_p(None), ctypes.c_size_t(0), ctypes.c_uint32(1)
    )
    return int(abi) if abi > 0 else 0


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _is_under(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


class _Rules:
    """Collects (path, rights) and adds them to a ruleset, skipping paths that do not exist."""

    def __init__(self, libc: Any, sysnr: dict[str, int], ruleset: int, handled: int) -> None:
        self.libc, self.sysnr, self.ruleset, self.handled = libc, sysnr, ruleset, handled
        self.added = 0
        self.failed: list[str] = []

    def add(self, path: str, rights: int, is_dir: bool | None = None) -> None:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return
        try:
            self.add_fd(fd, path, rights, is_dir)
        finally:
            os.close(fd)

    def add_fd(self, fd: int, path: str, rights: int, is_dir: bool | None = None) -> None:
        """The rule for `path`, opened (O_PATH) as `fd`."""
        if is_dir is None:
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
        allowed = rights & self.handled & (~0 if is_dir else _FS_FILE_RIGHTS)
        attr = _PathBeneath(allowed, fd)
        rc = self.libc.syscall(
            ctypes.c_long(self.sysnr["ll_add"]),
            ctypes.c_int(self.ruleset),
            ctypes.c_int(_RULE_PATH_BENEATH),
            ctypes.byref(attr),
            ctypes.c_uint32(0),
        )
        if rc == 0:
            self.added += 1
        else:
            self.failed.append(f"{path}: {errno_text()}")


def _plan_read_tree(path: str, hidden: list[str], out: list[tuple[str, int, bool]]) -> None:
    """(path, rights, is a folder) for read access beneath `path`, except the files of folders in
    `hidden` (the folder is split child by child down to them)."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return
    inside = [h for h in hidden if _is_under(h, path)]
    if not inside:
        out.append((path, _FS_READ_FILE | _FS_READ_DIR, is_dir))
        return
    if any(h == path for h in inside):
        return
    out.append((path, _FS_READ_DIR, is_dir))  # listing is needed (import finders)
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        _plan_read_tree(os.path.join(path, name), inside, out)


_read_plans: dict[tuple[Any, ...], tuple[list[str], list[str], list[tuple[str, int, bool]]]] = {}
# Every read rule's path opened (O_PATH; -1 where it is missing), by plan: a zygote keeps them and
# each worker it forks inherits them, hands them to the kernel and closes its copies
# (`release_opened_plans`): walking the plan's paths again in every worker would make a forked
# worker's hardening slower than adding the rules from open descriptors (docs/performance.md, "Figures behind choices in the code").
_opened_plans: dict[tuple[Any, ...], list[int]] = {}


def _plan_key(spec: dict[str, Any]) -> tuple[Any, ...]:
    return (tuple(map(str, spec.get("read_only", []))), bool(spec.get("allow_site_packages")))


def read_plan(spec: dict[str, Any]) -> tuple[list[str], list[str], list[tuple[str, int, bool]]]:
    """(read roots, hidden folders, read rules) for `spec`, worked out once per process: a zygote
    (zygote.py) does it before it forks, so its workers only hand the rules to the kernel."""
    key = _plan_key(spec)
    if key not in _read_plans:
        roots, hidden = _read_paths(spec)
        rules: list[tuple[str, int, bool]] = []
        for root in roots:
            _plan_read_tree(root, hidden, rules)
        _read_plans[key] = (roots, hidden, rules)
    return _read_plans[key]


def open_plan(spec: dict[str, Any]) -> None:
    """Open the paths of `spec`'s read rules, once per process (a zygote's, before it forks)."""
    key = _plan_key(spec)
    if key in _opened_plans:
        return
    fds: list[int] = []
    try:
        for path, _rights, _is_dir in read_plan(spec)[2]:
            try:
                fds.append(os.open(path, os.O_PATH | os.O_CLOEXEC))
            except OSError:
                fds.append(-1)
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise
    _opened_plans[key] = fds


def release_opened_plans() -> None:
    """Close every descriptor `open_plan` opened here or in the zygote this process was forked
    from: code run later in the worker must not hold them."""
    plans = list(_opened_plans.values())
    _opened_plans.clear()
    for fds in plans:
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _read_paths(spec: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(read-only roots, hidden package folders) for this interpreter and the user's allow-list."""
    stdlib = os.path.dirname(os.__file__)
    roots = [stdlib]
    roots += [p for p in sys.path if p.endswith("lib-dynload")]
    # Folders of shared libraries already mapped (libpython, libc): their neighbours load later.
    mapped: set[str] = set()
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5]:
                    mapped.add(os.path.dirname(parts[5].strip()))
    except OSError:
        pass
    roots += sorted(mapped)
    multiarch = getattr(sys.implementation, "_multiarch", None)
    if multiarch:
        roots += [f"/lib/{multiarch}", f"/usr/lib/{multiarch}"]
    roots += list(_SYSTEM_READ)
    roots += [str(p) for p in spec.get("read_only", [])]
    hidden: list[str] = []
    if not spec.get("allow_site_packages"):
        import site

        candidates = list(sys.path)
        try:
            candidates += [*site.getsitepackages(), site.getusersitepackages()]
        except Exception:
            pass
        hidden = sorted({os.path.realpath(p) for p in candidates if os.path.basename(p) in _PACKAGE_DIRS})
        allowed = [os.path.realpath(str(p)) for p in spec.get("read_only", [])]
        hidden = [h for h in hidden if not any(_is_under(h, a) for a in allowed)]
    else:
        roots += [p for p in sys.path if os.path.basename(p) in _PACKAGE_DIRS]
    real: list[str] = []
    for r in dict.fromkeys(roots):
        rp = os.path.realpath(r)
        if rp not in real and os.path.exists(rp):
            real.append(rp)
    return real, hidden


def apply_landlock(libc: Any, sysnr: dict[str, int], spec: dict[str, Any], abi: int, report: Report) -> bool:
    handled = (1 << 13) - 1
    if abi >= 2:
        handled |= _FS_REFER
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV
    attr = _RulesetAttr(handled, 0, 0)
    size = 8
    if abi >= 4:
        attr.net = _NET_BIND_TCP | _NET_CONNECT_TCP  # handled with no rule: every TCP bind/connect denied
        size = 16
    scopes = []
    if abi >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL
        size = 24
        scopes = ["abstract_unix_socket", "signal"]
    ruleset = libc.syscall(
        ctypes.c_long(sysnr["ll_create"]), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if ruleset < 0:
        report.warn(f"landlock_create_ruleset() failed: {errno_text()}")
        return False
    try:
        rules = _Rules(libc, sysnr, int(ruleset), handled)
        roots, hidden, planned = read_plan(spec)
        opened = _opened_plans.get(_plan_key(spec))
        if opened is not None and len(opened) == len(planned):
            for fd, (path, rights, is_dir) in zip(opened, planned, strict=True):
                if fd >= 0:
                    rules.add_fd(fd, path, rights, is_dir)
        else:
            for path, rights, is_dir in planned:
                rules.add(path, rights, is_dir)
        everything = handled & ~(_FS_EXECUTE | _FS_MAKE_CHAR | _FS_MAKE_BLOCK | _FS_IOCTL_DEV)
        for path in spec.get("read_write", []):
            rules.add(str(path), everything)
        rules.add("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE)
        if rules.failed:
            report.warn("some Landlock rules were refused: " + "; ".join(rules.failed[:5]))
        threads = _thread_count()
        flags = 0
        if threads > 1:
            if abi >= 8:
                flags |= _RESTRICT_SELF_TSYNC
            else:
                report.warn(f"{threads} threads exist while hardening: Landlock covers only the calling one")
        rc = libc.syscall(ctypes.c_long(sysnr["ll_restrict"]), ctypes.c_int(ruleset), ctypes.c_uint32(flags))
        if rc != 0:
            report.warn(f"landlock_restrict_self() failed: {errno_text()}")
            return False
    finally:
        os.close(int(ruleset))
    report.data.update(
        landlock=abi,
        landlock_fs=True,
        landlock_net=abi >= 4,
        landlock_scopes=scopes,
        landlock_rules=rules.added,
        landlock_read=roots,
        landlock_hidden=hidden,
    )
    return True


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def landlock_abi() -> int:
    """This kernel's Landlock ABI version, 0 where there is none (or no syscall table for us)."""
    machine = os.uname().machine
    if sys.platform != "linux" or machine not in SYSCALLS:
        return 0
    return kernel_abi(libc_handle(), SYSCALLS[machine])
