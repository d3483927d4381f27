"""The seccomp filter: a classic-BPF program that denies what a REPL has no use for."""

from __future__ import annotations

import ctypes
import functools
import os

from .syscalls import PR_GET_SECCOMP, Report, errno_text

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_AF_UNIX = 1
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
# clone() flags that create namespaces (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
_CLONE_NS_MASK = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_X32_SYSCALL_BIT = 0x40000000
_MAP_SHARED, _MAP_ANONYMOUS = 0x01, 0x20  # MAP_SHARED_VALIDATE (0x03) has the same low bit

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
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "msgget": (68, 186),
    "mq_open": (240, 180),
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
    "mmap": (9, 222),
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
    "clock_adjtime sethostname setdomainname vhangup iopl ioperm modify_ldt uselib _sysctl "
    # Memory no rlimit counts: shared memory lives on when the process that made it dies, and
    # RLIMIT_DATA sees only private pages. (/dev/shm files are a tmpfs with a size: bwrap.py.)
    "memfd_create memfd_secret shmget msgget mq_open"
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
    # mmap(): shared anonymous memory (mmap.mmap(-1, n)) is not counted by RLIMIT_DATA; private is.
    a.jeq(nr("mmap"), 0, 5)  # type: ignore[arg-type]
    a.ld(_arg(3))
    a.jset(_MAP_ANONYMOUS, 0, 2)
    a.jset(_MAP_SHARED, 0, 1)
    a.ret(deny)
    a.ret(_RET_ALLOW)
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


def apply_seccomp(
    libc: Any, sysnr: dict[str, int], machine: str, restrict_signals: bool, report: Report
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
        detail = errno_text() if rc < 0 else f"thread {rc} could not be synchronised"
        report.warn(f"seccomp() failed: {detail}")
        return False
    report.data["seccomp_instructions"] = count
    return libc.prctl(PR_GET_SECCOMP, 0, 0, 0, 0) == 2
