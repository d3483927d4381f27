"""Worker-side lockdown: rlimits, capabilities, Landlock and seccomp, applied before generated code runs.

Standard library only. `worker.py` loads this file by its path (a sandbox folder on sys.path would
shadow the standard library with our `subprocess.py`), calls `apply(spec)` once while the process
still has a single thread, and sends the returned report to the host. The report only states what
the kernel accepted: every entry comes from a syscall's return value or a read-back, and the two
main layers are probed afterwards (listing "/" must fail, `socket()` must fail).

Order matters: read what needs /proc first, then set rlimits, then no_new_privs, drop capabilities
(as root, rlimits bind only without CAP_SYS_RESOURCE), Landlock, and seccomp last.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import resource
import signal
import socket
import stat
import sys
import time
from typing import Any

# -- constants (include/uapi/linux/*.h) -----------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_PR_GET_NO_NEW_PRIVS = 39
_PR_GET_SECCOMP = 21
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAP_VERSION_3 = 0x20080522

_SYS = {  # the syscalls we call ourselves, per machine
    "x86_64": {"capset": 126, "seccomp": 317, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
    "aarch64": {"capset": 91, "seccomp": 277, "ll_create": 444, "ll_add": 445, "ll_restrict": 446},
}

# Landlock filesystem rights, by the ABI that introduced them.
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

# -- seccomp ----------------------------------------------------------------------------------------

_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_AF_UNIX = 1
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
# clone() flags that create namespaces (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
_CLONE_NS_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_X32_SYSCALL_BIT = 0x40000000

# Syscall numbers, x86_64 then aarch64 (asm-generic). None: the call does not exist there.
_NR: dict[str, tuple[int | None, int | None]] = {
    "socket": (41, 198),
    "socketpair": (53, 199),
    "connect": (42, 203),
    "bind": (49, 200),
    "listen": (50, 201),
    "accept": (43, 202),
    "accept4": (288, 242),
    "execve": (59, 221),
    "execveat": (322, 281),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "process_madvise": (440, 440),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "fanotify_init": (300, 262),
    "setsid": (112, 157),
    "setpgid": (109, 154),
    "setrlimit": (160, 164),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "reboot": (169, 142),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "lookup_dcookie": (212, 18),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "adjtimex": (159, 171),
    "clock_adjtime": (305, 266),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "vhangup": (153, 58),
    "iopl": (172, None),
    "ioperm": (173, None),
    "modify_ldt": (154, None),
    "uselib": (134, None),
    "_sysctl": (156, None),
    # checked by argument, or ENOSYS
    "clone": (56, 220),
    "clone3": (435, 435),
    "prlimit64": (302, 261),
    "setpriority": (141, 140),
    "sched_setaffinity": (203, 122),
    "sched_setscheduler": (144, 119),
    "sched_setparam": (142, 118),
    "sched_setattr": (314, 274),
    "ioprio_set": (251, 30),
    "migrate_pages": (256, 238),
    "move_pages": (279, 239),
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "pidfd_send_signal": (424, 424),
    "fcntl": (72, 25),
}
_ARCH = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}

# Denied outright with EPERM. The worker's own socketpair was created by the host, so denying
# socket() leaves the channel working while closing every way to the network and to Unix sockets.
_DENY = (
    "socket connect bind listen accept accept4 execve execveat ptrace process_vm_readv process_vm_writev "
    "process_madvise kcmp pidfd_getfd mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig "
    "fsmount fspick mount_setattr unshare setns bpf io_uring_setup io_uring_enter io_uring_register "
    "kexec_load kexec_file_load keyctl add_key request_key perf_event_open userfaultfd init_module "
    "finit_module delete_module open_by_handle_at name_to_handle_at fanotify_init setsid setpgid setrlimit "
    "swapon swapoff reboot acct quotactl syslog lookup_dcookie settimeofday clock_settime adjtimex "
    "clock_adjtime sethostname setdomainname vhangup iopl ioperm modify_ldt uselib _sysctl"
).split()
# Calls that may only target the caller itself (argument index of the pid; 0 means "self").
_SELF_ONLY = {
    "setpriority": 1,
    "sched_setaffinity": 0,
    "sched_setscheduler": 0,
    "sched_setparam": 0,
    "sched_setattr": 0,
    "ioprio_set": 1,
    "migrate_pages": 0,
    "move_pages": 0,
}


class _Asm:
    """A tiny classic-BPF assembler (jumps are relative instruction counts, as the kernel wants)."""

    def __init__(self) -> None:
        self.code: list[tuple[int, int, int, int]] = []

    def ld(self, offset: int) -> None:
        self.code.append((0x20, 0, 0, offset))  # BPF_LD | BPF_W | BPF_ABS

    def ret(self, value: int) -> None:
        self.code.append((0x06, 0, 0, value))  # BPF_RET | BPF_K

    def jeq(self, k: int, jt: int = 0, jf: int = 0) -> None:
        self.code.append((0x15, jt, jf, k))  # BPF_JMP | BPF_JEQ | BPF_K

    def jge(self, k: int, jt: int = 0, jf: int = 0) -> None:
        self.code.append((0x35, jt, jf, k))

    def jset(self, k: int, jt: int = 0, jf: int = 0) -> None:
        self.code.append((0x45, jt, jf, k))

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (op, jt, jf, k) in enumerate(self.code):
            offs = [jt, jf]
            if not all(0 <= o <= 255 for o in offs):
                raise ValueError(f"BPF jump out of range at {i}: {offs}")
            out += op.to_bytes(2, "little") + bytes(offs) + k.to_bytes(4, "little")
        return bytes(out)


def _arg(i: int, high: bool = False) -> int:
    return 16 + 8 * i + (4 if high else 0)  # struct seccomp_data: nr, arch, ip, args[6] (little-endian)


@functools.lru_cache(maxsize=4)
def seccomp_filter(machine: str, *, own_pid: int, own_pgid: int, restrict_signals: bool) -> bytes:
    """The classic-BPF program for `machine`; raises KeyError for machines we have no table for."""
    col, audit_arch = _ARCH[machine]

    def nr(name: str) -> int | None:
        return _NR[name][col]

    a = _Asm()
    a.ld(4)
    a.jeq(audit_arch, 1, 0)
    a.ret(_RET_KILL_PROCESS)  # another ABI (i386 via int 0x80 reports AUDIT_ARCH_I386): never
    a.ld(0)
    if machine == "x86_64":  # x32 calls share the arch token: refuse them all
        a.jge(_X32_SYSCALL_BIT, 0, 1)
        a.ret(_RET_ERRNO | _EPERM)
    deny = _RET_ERRNO | _EPERM
    for name in _DENY:
        n = nr(name)
        if n is not None:
            a.jeq(n, 0, 1)
            a.ret(deny)
    # clone3 takes its flags in a struct BPF cannot read: ENOSYS makes glibc fall back to clone().
    a.jeq(nr("clone3"), 0, 1)  # type: ignore[arg-type]
    a.ret(_RET_ERRNO | _ENOSYS)
    # clone(): plain processes and threads yes, new namespaces no.
    a.jeq(nr("clone"), 0, 4)  # type: ignore[arg-type]
    a.ld(_arg(0))
    a.jset(_CLONE_NS_MASK, 0, 1)
    a.ret(deny)
    a.ret(_RET_ALLOW)
    # socketpair(): AF_UNIX only (asyncio and multiprocessing need a private pair; it reaches nothing).
    a.jeq(nr("socketpair"), 0, 4)  # type: ignore[arg-type]
    a.ld(_arg(0))
    a.jeq(_AF_UNIX, 0, 1)
    a.ret(_RET_ALLOW)
    a.ret(deny)
    # prlimit64(): reading our own limits only. Same-uid processes could otherwise lower the host's.
    a.jeq(nr("prlimit64"), 0, 8)  # type: ignore[arg-type]
    a.ld(_arg(0))
    a.jeq(0, 0, 5)
    a.ld(_arg(2))
    a.jeq(0, 0, 3)
    a.ld(_arg(2, high=True))
    a.jeq(0, 0, 1)
    a.ret(_RET_ALLOW)
    a.ret(deny)
    for name, index in _SELF_ONLY.items():
        a.jeq(nr(name), 0, 4)  # type: ignore[arg-type]
        a.ld(_arg(index))
        a.jeq(0, 0, 1)
        a.ret(_RET_ALLOW)
        a.ret(deny)
    if restrict_signals:
        # Without Landlock's signal scoping: signals to ourselves (and our own group) only.
        me, group = own_pid & 0xFFFFFFFF, (-own_pgid) & 0xFFFFFFFF
        a.jeq(nr("kill"), 0, 6)  # type: ignore[arg-type]
        a.ld(_arg(0))
        a.jeq(0, 3, 0)
        a.jeq(me, 2, 0)
        a.jeq(group, 1, 0)
        a.ret(deny)
        a.ret(_RET_ALLOW)
        for name in ("tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
            a.jeq(nr(name), 0, 4)  # type: ignore[arg-type]
            a.ld(_arg(0))
            a.jeq(me, 0, 1)
            a.ret(_RET_ALLOW)
            a.ret(deny)
        for name in ("tkill", "pidfd_send_signal"):
            a.jeq(nr(name), 0, 1)  # type: ignore[arg-type]
            a.ret(deny)
        # fcntl(F_SETOWN/F_SETSIG) would let SIGIO carry any signal to any same-uid process.
        a.jeq(nr("fcntl"), 0, 6)  # type: ignore[arg-type]
        a.ld(_arg(1))
        a.jeq(_F_SETOWN, 2, 0)
        a.jeq(_F_SETSIG, 1, 0)
        a.jeq(_F_SETOWN_EX, 0, 1)
        a.ret(deny)
        a.ret(_RET_ALLOW)
    a.ret(_RET_ALLOW)
    return a.assemble()


# -- the report ------------------------------------------------------------------------------------


class _Report:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "requested": True,
            "machine": os.uname().machine,
            "euid": os.geteuid(),
            "rlimits": {},
            "no_new_privs": False,
            "capabilities": None,
            "landlock": False,
            "landlock_fs": False,
            "landlock_net": False,
            "landlock_scopes": [],
            "seccomp": False,
            "signals": "unrestricted",
            "namespaces": [],
            "verified": {},
            "warnings": [],
        }

    def warn(self, text: str) -> None:
        self.data["warnings"].append(text)


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return libc


def _err() -> str:
    return os.strerror(ctypes.get_errno())


# -- steps -----------------------------------------------------------------------------------------


def _namespaces(host: dict[str, str]) -> list[str]:
    """The namespaces this process does not share with the host (compared by /proc/self/ns inode)."""
    out = []
    for name in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
        theirs = host.get(name)
        try:
            ours = os.readlink(f"/proc/self/ns/{name}")
        except OSError:
            continue
        if theirs and ours != theirs:
            out.append(name)
    return out


def _set_rlimits(spec: dict[str, Any], report: _Report) -> None:
    wanted = {
        "core": (resource.RLIMIT_CORE, 0),
        "fsize": (resource.RLIMIT_FSIZE, spec.get("max_file_bytes")),
        "nofile": (resource.RLIMIT_NOFILE, spec.get("max_open_files")),
        "data": (resource.RLIMIT_DATA, spec.get("memory_limit_bytes")),
    }
    for name, (res, value) in wanted.items():
        if value is None:
            continue
        try:
            resource.setrlimit(res, (int(value), int(value)))
        except (ValueError, OSError) as exc:
            report.warn(f"setrlimit({name}) failed: {exc}")
    for name, (res, _value) in wanted.items():
        _soft, hard = resource.getrlimit(res)  # read back: report what holds, not what we asked
        report.data["rlimits"][name] = None if hard == resource.RLIM_INFINITY else hard
    # Past RLIMIT_FSIZE a write must fail with EFBIG (an OSError the code sees), not kill the REPL.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _cap_line(field: str) -> str | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return line.split()[1]
    except OSError:
        pass
    return None


def _empty_capability_sets(libc: Any, sysnr: dict[str, int]) -> int:
    """Drop the bounding set, clear the ambient one, set the rest to nothing; capset's return code."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            last = int(fh.read().strip())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: nothing to drop then
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    return int(libc.syscall(ctypes.c_long(sysnr["capset"]), ctypes.byref(header), ctypes.byref(data)))


def drop_all_capabilities() -> None:
    """Empty every capability set, or raise: for a process that must not go on holding any (a
    zygote's child, which starts with what the zygote kept of bwrap's user namespace)."""
    rc = _empty_capability_sets(_libc(), _SYS[os.uname().machine])
    left = {name: _cap_line(name) for name in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")}
    if rc != 0 or any(value is None or int(value, 16) for value in left.values()):
        raise PermissionError(f"capabilities left after dropping them all: {left}")


def _drop_capabilities(libc: Any, sysnr: dict[str, int], report: _Report) -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets.

    Matters when the host runs as root: without CAP_SYS_RESOURCE the rlimits above cannot be raised
    again, without CAP_DAC_OVERRIDE file modes count, without CAP_KILL signals need a matching uid.
    """
    before = _cap_line("CapEff")
    rc = _empty_capability_sets(libc, sysnr)
    after = _cap_line("CapEff")
    bounding = _cap_line("CapBnd")
    report.data["capabilities"] = {
        "effective_before": before,
        "effective": after,
        "bounding": bounding,
        "dropped": rc == 0 and after is not None and int(after, 16) == 0,
    }
    if rc != 0:
        report.warn(f"capset() failed: {_err()}")


def _landlock_abi(libc: Any, sysnr: dict[str, int]) -> int:
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
                self.failed.append(f"{path}: {_err()}")
        finally:
            os.close(fd)


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


def _read_plan(spec: dict[str, Any]) -> tuple[list[str], list[str], list[tuple[str, int, bool]]]:
    """(read roots, hidden folders, read rules) for `spec`, worked out once per process: a zygote
    (zygote.py) does it before it forks, so its workers only hand the rules to the kernel."""
    key = (tuple(map(str, spec.get("read_only", []))), bool(spec.get("allow_site_packages")))
    if key not in _read_plans:
        roots, hidden = _read_paths(spec)
        rules: list[tuple[str, int, bool]] = []
        for root in roots:
            _plan_read_tree(root, hidden, rules)
        _read_plans[key] = (roots, hidden, rules)
    return _read_plans[key]


def prepare(spec: dict[str, Any]) -> None:
    """What `apply(spec)` would work out that is the same for every worker: do it now, once."""
    _read_plan(spec)
    with contextlib.suppress(KeyError):  # a machine without a table: apply() says so
        seccomp_filter(os.uname().machine, own_pid=0, own_pgid=0, restrict_signals=False)


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


def _apply_landlock(
    libc: Any, sysnr: dict[str, int], spec: dict[str, Any], abi: int, report: _Report
) -> bool:
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
        report.warn(f"landlock_create_ruleset() failed: {_err()}")
        return False
    try:
        rules = _Rules(libc, sysnr, int(ruleset), handled)
        roots, hidden, planned = _read_plan(spec)
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
            report.warn(f"landlock_restrict_self() failed: {_err()}")
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


def _apply_seccomp(
    libc: Any, sysnr: dict[str, int], machine: str, restrict_signals: bool, report: _Report
) -> bool:
    try:
        # Without the signal rules the program names no pid: the same one for every worker, built once.
        pid, pgid = (os.getpid(), os.getpgrp()) if restrict_signals else (0, 0)
        program = seccomp_filter(machine, own_pid=pid, own_pgid=pgid, restrict_signals=restrict_signals)
    except KeyError:
        report.warn(f"no seccomp syscall table for {machine}: seccomp not applied")
        return False
    count = len(program) // 8
    buf = ctypes.create_string_buffer(program, len(program))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(count, ctypes.addressof(buf))
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC): every thread gets the filter.
    rc = libc.syscall(ctypes.c_long(sysnr["seccomp"]), ctypes.c_uint(1), ctypes.c_uint(1), ctypes.byref(prog))
    if rc != 0:
        detail = _err() if rc < 0 else f"thread {rc} could not be synchronised"
        report.warn(f"seccomp() failed: {detail}")
        return False
    report.data["seccomp_instructions"] = count
    return libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) == 2


def _probe(report: _Report) -> None:
    """Check from the inside that the layers hold: these must fail now."""
    verified = report.data["verified"]
    try:
        os.listdir("/")
        verified["filesystem"] = False
    except PermissionError:
        verified["filesystem"] = True
    except OSError:
        verified["filesystem"] = False
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        verified["network"] = False
    except PermissionError:
        verified["network"] = True
    except OSError:
        verified["network"] = False


def landlock_abi() -> int:
    """This kernel's Landlock ABI version, 0 where there is none (or no syscall table for us)."""
    machine = os.uname().machine
    if sys.platform != "linux" or machine not in _SYS:
        return 0
    return _landlock_abi(_libc(), _SYS[machine])


# -- entry point -----------------------------------------------------------------------------------


def apply(spec: dict[str, Any]) -> dict[str, Any]:
    """Apply everything `spec` asks for that this kernel supports; returns the report for the host.

    spec: {"read_write": [scratch], "read_only": [...], "allow_site_packages": bool,
           "memory_limit_bytes", "max_file_bytes", "max_open_files": int | None,
           "landlock": bool, "landlock_max_abi": int | None, "seccomp": bool,
           "host_namespaces": {"pid": "pid:[4026531836]", ...}}
    """
    started = time.perf_counter()
    report = _Report()
    machine = report.data["machine"]
    report.data["namespaces"] = _namespaces(spec.get("host_namespaces") or {})
    _set_rlimits(spec, report)
    if sys.platform != "linux" or machine not in _SYS:
        report.warn(f"no Landlock/seccomp support for {sys.platform}/{machine}: only rlimits apply")
        report.data["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
        return report.data
    sysnr = _SYS[machine]
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        report.warn(f"prctl(PR_SET_NO_NEW_PRIVS) failed: {_err()}")
    report.data["no_new_privs"] = libc.prctl(_PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1
    _drop_capabilities(libc, sysnr, report)

    abi = _landlock_abi(libc, sysnr) if spec.get("landlock", True) else 0
    max_abi = spec.get("landlock_max_abi")
    if max_abi is not None:
        abi = min(abi, int(max_abi))
    if abi <= 0:
        report.warn(
            "Landlock is unavailable (kernel too old, disabled, or not in the LSM list): files are not confined"
        )
    elif not report.data["no_new_privs"]:
        report.warn("Landlock needs no_new_privs, which could not be set: files are not confined")
    else:
        _apply_landlock(libc, sysnr, spec, abi, report)
        if abi < 4:
            report.warn(f"Landlock ABI {abi} has no network rules: TCP is blocked by seccomp only")
    signals_scoped = "signal" in report.data["landlock_scopes"]
    if signals_scoped:
        report.data["signals"] = "landlock"

    if spec.get("seccomp", True):
        ok = _apply_seccomp(libc, sysnr, machine, not signals_scoped, report)
        report.data["seccomp"] = ok
        if ok and not signals_scoped:
            report.data["signals"] = "seccomp (self only)"
    else:
        report.warn("seccomp was turned off")
    if not report.data["seccomp"] and not signals_scoped:
        report.warn("signals are not restricted: the REPL may signal other processes of the same user")
    _probe(report)
    report.data["duration_ms"] = round((time.perf_counter() - started) * 1000, 3)
    return report.data
