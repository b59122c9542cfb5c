package objstore

import "syscall"

const syscallNoFollow = syscall.O_NOFOLLOW | syscall.O_CLOEXEC
