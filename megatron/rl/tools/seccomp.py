"""A seccomp-BPF filter for the python tool's sandbox: the system calls a tool never needs fail
with ``EPERM``; every other call is allowed.

Refused: kernel and mount administration (``mount``, ``umount2``, ``pivot_root``, ``chroot``,
``swapon``/``swapoff``, ``reboot``, ``kexec_*``, module loading, ``acct``, clock setting), new
namespaces and joining others (``unshare``, ``setns``), inspecting or writing other processes
(``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``, ``pidfd_getfd``), kernel attack surface
(``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring_*``, ``keyctl``/``add_key``/
``request_key``, ``open_by_handle_at``), and, on x86-64, the x32 ABI's numbers (which would
otherwise reach the same calls under other numbers). A program of another architecture is killed.

The program is built here (a few dozen BPF instructions, no libseccomp) and handed to bubblewrap
through a file descriptor (``bwrap --seccomp FD``), which installs it after setting up the
namespaces and before running the interpreter.
"""

from __future__ import annotations

import platform
import struct

# struct seccomp_data: nr (int) at offset 0, arch (u32) at offset 4
_NR, _ARCH = 0, 4
# classic BPF opcodes: ld word absolute, jump if equal / greater-or-equal to a constant, return
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_KILL_PROCESS, _ALLOW, _ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_EPERM = 1
_X32_BIT = 0x40000000

REFUSED = (
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "acct",
    "settimeofday",
    "clock_settime",
    "unshare",
    "setns",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "open_by_handle_at",
    "name_to_handle_at",
    "quotactl",
    "personality",
)
"""System calls the sandboxed program may not make."""

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""``AUDIT_ARCH_*`` of the architectures with a table below."""
_NUMBERS = {
    "x86_64": dict(
        mount=165,
        umount2=166,
        pivot_root=155,
        chroot=161,
        swapon=167,
        swapoff=168,
        reboot=169,
        kexec_load=246,
        kexec_file_load=320,
        init_module=175,
        finit_module=313,
        delete_module=176,
        acct=163,
        settimeofday=164,
        clock_settime=227,
        unshare=272,
        setns=308,
        ptrace=101,
        process_vm_readv=310,
        process_vm_writev=311,
        kcmp=312,
        pidfd_getfd=438,
        bpf=321,
        perf_event_open=298,
        userfaultfd=323,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        keyctl=250,
        add_key=248,
        request_key=249,
        open_by_handle_at=304,
        name_to_handle_at=303,
        quotactl=179,
        personality=135,
    ),
    "aarch64": dict(  # the generic table (include/uapi/asm-generic/unistd.h)
        mount=40,
        umount2=39,
        pivot_root=41,
        chroot=51,
        swapon=224,
        swapoff=225,
        reboot=142,
        kexec_load=104,
        kexec_file_load=294,
        init_module=105,
        finit_module=273,
        delete_module=106,
        acct=89,
        settimeofday=170,
        clock_settime=112,
        unshare=97,
        setns=268,
        ptrace=117,
        process_vm_readv=270,
        process_vm_writev=271,
        kcmp=272,
        pidfd_getfd=438,
        bpf=280,
        perf_event_open=241,
        userfaultfd=282,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
        keyctl=219,
        add_key=217,
        request_key=218,
        open_by_handle_at=265,
        name_to_handle_at=264,
        quotactl=60,
        personality=92,
    ),
}
"""System call numbers of ``REFUSED`` per architecture."""


def supported(machine: str | None = None) -> bool:
    """Whether a filter can be built for ``machine`` (default: this one)."""
    return (machine or platform.machine()) in _NUMBERS


def _instruction(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def filter_program(machine: str | None = None) -> bytes:
    """The compiled filter (``struct sock_filter`` array) for ``machine`` (default: this one);
    ``ValueError`` naming the architecture when there is no table for it."""
    machine = machine or platform.machine()
    if machine not in _NUMBERS:
        raise ValueError(
            f"no seccomp table for architecture {machine!r} (known: {', '.join(_NUMBERS)})"
        )
    numbers = sorted({_NUMBERS[machine][name] for name in REFUSED})
    deny = _instruction(_RET, _ERRNO | _EPERM)
    program = [
        _instruction(_LD_ABS, _ARCH),
        _instruction(_JEQ, _AUDIT_ARCH[machine], jt=1),  # another ABI: kill
        _instruction(_RET, _KILL_PROCESS),
        _instruction(_LD_ABS, _NR),
    ]
    body = []
    if machine == "x86_64":
        body.append(("x32", _JGE, _X32_BIT))
    body += [("nr", _JEQ, nr) for nr in numbers]
    # each test jumps to the shared "deny" at the end (past the remaining tests and "allow")
    for i, (_, op, k) in enumerate(body):
        program.append(_instruction(op, k, jt=len(body) - i))
    program += [_instruction(_RET, _ALLOW), deny]
    return b"".join(program)
