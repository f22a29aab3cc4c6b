// Package netns makes network namespaces for sandboxes: their own, holding only a
// loopback interface that is up.
package netns

import (
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// LoopbackUp sets "lo" up in the calling thread's network namespace.
func LoopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// New makes a network namespace with its loopback up and returns it open. It lives as
// long as a descriptor or a process refers to it.
func New() (*os.File, error) {
	type result struct {
		f   *os.File
		err error
	}
	ch := make(chan result, 1)
	go func() {
		// The thread that unshares is never returned to the runtime: the goroutine exits
		// locked and Go ends the thread with it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- result{err: err}
			return
		}
		f, err := os.Open("/proc/thread-self/ns/net")
		if err == nil {
			err = LoopbackUp()
		}
		ch <- result{f, err}
	}()
	r := <-ch
	if r.err != nil && r.f != nil {
		r.f.Close()
	}
	return r.f, r.err
}
