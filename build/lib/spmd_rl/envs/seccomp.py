"""The seccomp filter of the python environment's jail (``envs.jail``), as the classic BPF
program bubblewrap loads (``bwrap --seccomp FD``): built here, by hand, so no libseccomp is
needed.

The program, over ``struct seccomp_data`` (nr at offset 0, arch at 4, args from 16):

1. a foreign architecture (or x86_64's x32 ABI, numbers >= 2**30) kills the process: its
   syscall numbers mean other calls;
2. ``clone`` with any namespace flag, and every call of ``DENIED`` (leaving or making
   namespaces, mounting, tracing another process, loading BPF or kernel modules, reading
   another process's memory, keyrings, rebooting), fail with EPERM;
3. ``clone3``, whose flags live in memory a filter cannot read, fails with ENOSYS, so the C
   library falls back to ``clone`` (checked above);
4. anything else is allowed.

Invariant: the numbers are the kernel's own (``asm/unistd_64.h`` and ``asm-generic/unistd.h``,
checked in the tests against the headers where they are installed).
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""``AUDIT_ARCH_X86_64`` and ``AUDIT_ARCH_AARCH64``."""

DENIED = (
    "setns",
    "unshare",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "ptrace",
    "bpf",
    "process_vm_readv",
    "process_vm_writev",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "reboot",
    "swapon",
    "swapoff",
    "open_by_handle_at",
    "userfaultfd",
    "fsopen",
    "fsmount",
    "move_mount",
    "open_tree",
    "fsconfig",
    "fspick",
    "mount_setattr",
)

NUMBERS = {
    "x86_64": {
        "setns": 308,
        "unshare": 272,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "ptrace": 101,
        "bpf": 321,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "perf_event_open": 298,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "open_by_handle_at": 304,
        "userfaultfd": 323,
        "fsopen": 430,
        "fsmount": 432,
        "move_mount": 429,
        "open_tree": 428,
        "fsconfig": 431,
        "fspick": 433,
        "mount_setattr": 442,
        "clone": 56,
        "clone3": 435,
    },
    "aarch64": {
        "setns": 268,
        "unshare": 97,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "ptrace": 117,
        "bpf": 280,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "perf_event_open": 241,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "kexec_load": 104,
        "reboot": 142,
        "swapon": 224,
        "swapoff": 225,
        "open_by_handle_at": 265,
        "userfaultfd": 282,
        "fsopen": 430,
        "fsmount": 432,
        "move_mount": 429,
        "open_tree": 428,
        "fsconfig": 431,
        "fspick": 433,
        "mount_setattr": 442,
        "clone": 220,
        "clone3": 435,
    },
}

NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET and NEWTIME."""

_LD_ABS_W, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_KILL, _ALLOW, _ERRNO = 0x80000000, 0x7FFF0000, 0x00050000


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (default: this machine's) as ``struct sock_filter`` records."""
    arch = arch or platform.machine()
    if arch not in NUMBERS:
        raise ValueError(f"no seccomp filter for {arch}: the python environment's jail knows {', '.join(NUMBERS)}")
    nr = NUMBERS[arch]
    denied = [nr[name] for name in DENIED]
    # the tail, from its end: [ALLOW, DENY(EPERM), NOSYS, KILL]; offsets are counted from the next instruction
    body = [_op(_LD_ABS_W, 4), None, _op(_RET, _KILL), _op(_LD_ABS_W, 0)]
    checks: list[tuple[str, int]] = []
    if arch == "x86_64":
        checks.append(("x32", 0x40000000))
    checks += [("clone", nr["clone"]), ("clone3", nr["clone3"])] + [("deny", n) for n in denied]
    # layout after the checks: ALLOW, EPERM, ENOSYS, KILL, CLONE_ARGS (LD arg0, JSET -> EPERM, ALLOW)
    n = len(checks)
    eperm, enosys, kill, clone_args = n + 1, n + 2, n + 3, n + 4  # ALLOW is n: the fall-through
    for i, (kind, k) in enumerate(checks):
        target = {"x32": kill, "clone": clone_args, "clone3": enosys, "deny": eperm}[kind]
        body.append(_op(_JGE if kind == "x32" else _JEQ, k, jt=target - (i + 1)))
    tail = [
        _op(_RET, _ALLOW),
        _op(_RET, _ERRNO | errno.EPERM),
        _op(_RET, _ERRNO | errno.ENOSYS),
        _op(_RET, _KILL),
        _op(_LD_ABS_W, 16),  # clone's first argument, the flags (low 32 bits, little-endian)
        _op(_JSET, NAMESPACE_FLAGS, jt=1),
        _op(_RET, _ALLOW),
        _op(_RET, _ERRNO | errno.EPERM),
    ]
    body[1] = _op(_JEQ, AUDIT_ARCH[arch], jt=1)  # the right architecture skips the kill
    return b"".join(body + tail)
