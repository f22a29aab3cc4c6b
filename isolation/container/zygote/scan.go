package zygote

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/isolation"
)

// procDir is /proc/<pid>.
func procDir(pid int) string { return "/proc/" + strconv.Itoa(pid) }

// status reads the fields of /proc/<pid>/status this package checks.
type status struct {
	threads        int
	tracer         int
	sigPnd, shdPnd string
	vmLck          string
	nsPid          int // innermost
	ppid           int
}

func readStatus(pid int) (status, error) {
	var st status
	b, err := os.ReadFile(procDir(pid) + "/status")
	if err != nil {
		return st, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Threads":
			st.threads, _ = strconv.Atoi(v)
		case "TracerPid":
			st.tracer, _ = strconv.Atoi(v)
		case "SigPnd":
			st.sigPnd = v
		case "ShdPnd":
			st.shdPnd = v
		case "VmLck":
			st.vmLck = v
		case "PPid":
			st.ppid, _ = strconv.Atoi(v)
		case "NSpid":
			f := strings.Fields(v)
			if len(f) > 0 {
				st.nsPid, _ = strconv.Atoi(f[len(f)-1])
			}
		}
	}
	return st, nil
}

// NSPid is pid's PID in its innermost pid namespace.
func NSPid(pid int) (int, error) {
	st, err := readStatus(pid)
	if err != nil {
		return 0, err
	}
	return st.nsPid, nil
}

// Tracer returns the PID of the process tracing pid (0 for none).
func Tracer(pid int) (int, error) {
	st, err := readStatus(pid)
	return st.tracer, err
}

// Children lists the children of pid (of all its threads).
func Children(pid int) ([]int, error) {
	tasks, err := os.ReadDir(procDir(pid) + "/task")
	if err != nil {
		return nil, err
	}
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(procDir(pid), "task", t.Name(), "children"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	sort.Ints(out)
	return out, nil
}

// sessionOf returns the session and process group IDs of pid (in its pid namespace).
func sessionOf(pid int) (sid, pgid int, err error) {
	f, err := isolation.StatFields(procDir(pid) + "/stat") // state ppid pgrp session ...
	if err != nil {
		return 0, 0, err
	}
	if len(f) < 4 {
		return 0, 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	pgid, err1 := strconv.Atoi(f[2])
	sid, err2 := strconv.Atoi(f[3])
	return sid, pgid, errors.Join(err1, err2)
}

// checkBefore rejects a process that cannot be seized or captured, from what can be
// read before stopping it.
func checkBefore(pid, init int) error {
	switch st := ptrace.ProcState(pid); st {
	case "Z", "X":
		return &Ineligible{Reason: fmt.Sprintf("process %d has exited and init has not reaped it yet", pid), ending: true}
	case "gone":
		return &Ineligible{Reason: fmt.Sprintf("process %d has exited", pid), ending: true}
	case "T", "t":
		comm, _ := os.ReadFile(procDir(pid) + "/comm")
		return ineligible("process %d (%s) is stopped", pid, bytes.TrimSpace(comm))
	}
	st, err := readStatus(pid)
	if err != nil {
		return err
	}
	if st.tracer != 0 {
		return ineligible("process %d is being traced (pid %d, a debugger?)", pid, st.tracer)
	}
	if st.ppid != init {
		return ineligible("process %d is not a child of init (a process tree)", pid)
	}
	return nil
}

// scan records the state of a stopped process that fork does not copy, or says why the
// process cannot be a zygote.
//
// Preconditions: pid is stopped by us (ptrace).
//
// rootMnt is the mount ID of the process's root (rootMount), which the processes of a
// sandbox share.
func scan(pid, rootMnt int) (*Proc, error) {
	st, err := readStatus(pid)
	if err != nil {
		return nil, err
	}
	switch {
	case st.threads != 1:
		return nil, ineligible("process %d has %d threads", pid, st.threads)
	case strings.Trim(st.sigPnd, "0") != "" || strings.Trim(st.shdPnd, "0") != "":
		return nil, ineligible("process %d has pending signals", pid)
	case st.vmLck != "" && !strings.HasPrefix(st.vmLck, "0 "):
		return nil, ineligible("process %d has locked memory (%s)", pid, st.vmLck)
	}
	if sid, pgid, err := sessionOf(pid); err != nil {
		return nil, err
	} else if sid != pid || pgid != pid { // host PIDs, as /proc reads them
		return nil, ineligible("process %d does not lead its own session and process group", pid)
	}
	if kids, err := Children(pid); err != nil {
		return nil, err
	} else if len(kids) > 0 {
		return nil, ineligible("process %d has child processes", pid)
	}
	if b, err := os.ReadFile(procDir(pid) + "/timers"); err == nil && len(strings.TrimSpace(string(b))) > 0 {
		return nil, ineligible("process %d has POSIX timers", pid)
	}
	p := &Proc{NSPid: st.nsPid}
	if root, _ := os.Readlink(procDir(pid) + "/root"); root != "/" {
		return nil, ineligible("process %d runs chrooted (%s)", pid, root)
	}
	if p.Cwd, err = pathInode(pid, "cwd"); err != nil {
		return nil, err
	}
	if p.Exe, err = os.Readlink(procDir(pid) + "/exe"); err != nil {
		return nil, err
	}
	if p.Fds, err = scanFds(pid, rootMnt); err != nil {
		return nil, err
	}
	if p.Maps, p.maps, err = scanMaps(pid); err != nil {
		return nil, err
	}
	if p.Locks, err = locksOf(pid, p.Fds); err != nil {
		return nil, err
	}
	return p, nil
}

// pathInode resolves the /proc/<pid>/<link> magic link (cwd, exe, fd/N).
func pathInode(pid int, link string) (Inode, error) {
	l := procDir(pid) + "/" + link
	path, err := os.Readlink(l)
	if err != nil {
		return Inode{}, err
	}
	if strings.HasSuffix(path, " (deleted)") {
		return Inode{}, ineligible("process %d: %s is a deleted file (%s)", pid, link, path)
	}
	var s unix.Stat_t
	if err := unix.Stat(l, &s); err != nil {
		return Inode{}, err
	}
	return Inode{Path: path, Dev: s.Dev, Ino: s.Ino}, nil
}

// rootMount is the mount ID of pid's root directory (statx of /proc/<pid>/root: a few
// microseconds, where reading its mountinfo took ~50), the ID fdinfo's mnt_id gives.
func rootMount(pid int) (int, error) {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, procDir(pid)+"/root", 0, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("process %d: the mount of its root: %w", pid, err)
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, fmt.Errorf("process %d: the mount of its root: statx gives no mount ID on this kernel (Linux 5.8 or later needed)", pid)
	}
	return int(st.Mnt_id), nil
}

// fdinfo is what /proc/<pid>/fdinfo/<fd> says.
type fdinfo struct {
	pos   int64
	flags int
	mnt   int
	// locks are the "lock:" lines: the locks on the file that this process (POSIX) or
	// this open file description (flock, OFD) holds.
	locks []string
}

func readFdinfo(pid, fd int) (fdinfo, error) {
	var fi fdinfo
	b, err := os.ReadFile(fmt.Sprintf("%s/fdinfo/%d", procDir(pid), fd))
	if err != nil {
		return fi, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "pos":
			fi.pos, _ = strconv.ParseInt(v, 10, 64)
		case "flags":
			f, _ := strconv.ParseInt(v, 8, 64)
			fi.flags = int(f)
		case "mnt_id":
			fi.mnt, _ = strconv.Atoi(v)
		case "lock":
			fi.locks = append(fi.locks, v)
		}
	}
	return fi, nil
}

// memDevices are the character devices a zygote may hold: they have no state.
var memDevices = map[string]bool{"/dev/null": true, "/dev/zero": true, "/dev/full": true,
	"/dev/random": true, "/dev/urandom": true}

// scanFds records every descriptor of pid.
func scanFds(pid, rootMnt int) ([]Fd, error) {
	ents, err := os.ReadDir(procDir(pid) + "/fd")
	if err != nil {
		return nil, err
	}
	var out []Fd
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		fd, err := scanFd(pid, n, rootMnt)
		if err != nil {
			return nil, err
		}
		out = append(out, fd)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Fd < out[j].Fd })
	return out, nil
}

func scanFd(pid, n, rootMnt int) (Fd, error) {
	link := fmt.Sprintf("%s/fd/%d", procDir(pid), n)
	target, err := os.Readlink(link)
	if err != nil {
		return Fd{}, err
	}
	fi, err := readFdinfo(pid, n)
	if err != nil {
		return Fd{}, err
	}
	fd := Fd{Fd: n, Flags: fi.flags, Pos: fi.pos, locks: fi.locks}
	var s unix.Stat_t
	if err := unix.Stat(link, &s); err != nil {
		return Fd{}, err
	}
	fd.Dev, fd.Ino = s.Dev, s.Ino
	switch {
	case strings.HasPrefix(target, "pipe:["):
		fd.Kind = KindPipe
	case !strings.HasPrefix(target, "/"):
		return Fd{}, ineligible("process %d: descriptor %d is %s", pid, n, target)
	case strings.HasSuffix(target, " (deleted)"):
		return Fd{}, ineligible("process %d: descriptor %d is a deleted file (%s)", pid, n, target)
	default:
		fd.Path = target
		switch s.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			fd.Kind = KindFile
		case unix.S_IFDIR:
			fd.Kind = KindDir
		case unix.S_IFIFO:
			fd.Kind = KindFIFO
		case unix.S_IFCHR:
			if !memDevices[target] {
				return Fd{}, ineligible("process %d: descriptor %d is the device %s", pid, n, target)
			}
			fd.Kind = KindChar
		default:
			return Fd{}, ineligible("process %d: descriptor %d is %s, of a kind zygotes do not keep", pid, n, target)
		}
		if fi.mnt != rootMnt {
			return Fd{}, ineligible("process %d: descriptor %d (%s) is on another mount than the root", pid, n, target)
		}
	}
	if fd.Kind == KindPipe || fd.Kind == KindFIFO {
		if fd.Data, err = peekPipe(link); err != nil {
			return Fd{}, fmt.Errorf("process %d: content of pipe %d: %w", pid, n, err)
		}
	}
	return fd, nil
}

// peekPipe returns the unread content of the pipe or FIFO behind a /proc fd link, without
// consuming it: tee(2) duplicates it into a pipe of ours.
func peekPipe(link string) ([]byte, error) {
	src, err := unix.Open(link, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(src)
	size, err := unix.FcntlInt(uintptr(src), unix.F_GETPIPE_SZ, 0)
	if err != nil {
		return nil, err
	}
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil, err
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	if _, err := unix.FcntlInt(uintptr(p[1]), unix.F_SETPIPE_SZ, size); err != nil {
		return nil, err
	}
	n, err := unix.Tee(src, p[1], size, unix.SPLICE_F_NONBLOCK)
	if errors.Is(err, unix.EAGAIN) || n == 0 {
		return nil, nil // empty
	}
	if err != nil {
		return nil, err
	}
	buf := make([]byte, n)
	got := 0
	for got < int(n) {
		m, err := unix.Read(p[0], buf[got:])
		if err != nil {
			return nil, err
		}
		got += m
	}
	return buf, nil
}

// scanMaps records the file-backed mappings, and rejects shared writable memory (a
// zygote would keep sharing it with the process it copies) and deleted files. It
// returns all the mappings too.
func scanMaps(pid int) ([]Map, []mapping, error) {
	ms, err := readMaps(pid)
	if err != nil {
		return nil, nil, err
	}
	var out []Map
	for _, m := range ms {
		if m.Perms[3] == 's' && m.Perms[1] == 'w' {
			return nil, nil, ineligible("process %d maps shared writable memory (%s)", pid, orAnon(m.Path))
		}
		if !strings.HasPrefix(m.Path, "/") {
			continue // anonymous, [heap], [stack], [vdso], [vvar]
		}
		if strings.HasSuffix(m.Path, " (deleted)") {
			return nil, nil, ineligible("process %d maps a deleted file (%s)", pid, m.Path)
		}
		out = append(out, Map{Start: m.Start, Path: m.Path})
	}
	return out, ms, nil
}

// readProc calls f with the content of a /proc file of unknown size, read in reads of
// 64 KiB or more: each read of a seq_file walks its records again from where the last
// stopped, and a process's maps read line by line took 140-170 µs against 45 µs in large
// reads (a Python process of 31 mappings). A read returns at most one page-sized buffer
// of records (~4 KiB), so it reads on until end of file: a single read missed the
// mappings after the first ~50. The buffer is reused (procBufs): f must not keep it.
// A buffer of 64 KiB made for each read was a tenth of what cairn allocated in W1, and
// with it the collections that ran during checkpoints and rewinds (package memtune).
func readProc(name string, f func([]byte) error) error {
	fd, err := os.Open(name)
	if err != nil {
		return err
	}
	defer fd.Close()
	bp := procBufs.Get().(*[]byte)
	defer procBufs.Put(bp)
	buf := (*bp)[:0]
	for {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, cap(buf))
			*bp = buf
		}
		n, err := fd.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) || (err == nil && n == 0) {
			return f(buf)
		}
		if err != nil {
			return err
		}
	}
}

// procBufs are readProc's buffers.
var procBufs = sync.Pool{New: func() any {
	b := make([]byte, 0, 64<<10)
	return &b
}}

func orAnon(path string) string {
	if path == "" {
		return "anonymous"
	}
	return path
}

// locksOf records the POSIX locks pid holds, from the "lock:" lines of its fdinfo (not
// /proc/locks: reading that waits for an RCU grace period, ~10 ms here), each tied to
// one of its descriptors on the locked file. flock and OFD locks belong to open file
// descriptions, which the zygote shares and cannot keep apart: not eligible.
func locksOf(pid int, fds []Fd) ([]Lock, error) {
	var out []Lock
	seen := map[string]bool{}
	for _, f := range fds {
		for _, l := range f.locks {
			// "1: POSIX  ADVISORY  WRITE 1234 00:2f:5678 1073741824 1073741825"
			fl := strings.Fields(l)
			if len(fl) < 8 {
				continue
			}
			if fl[1] != "POSIX" {
				return nil, ineligible("process %d holds a %s lock", pid, fl[1])
			}
			ino, err := parseLockInode(fl[5])
			if err != nil {
				return nil, err
			}
			key := fmt.Sprint(ino, fl[3], fl[6], fl[7])
			if seen[key] {
				continue // the same lock, seen from another descriptor on the file
			}
			seen[key] = true
			start, _ := strconv.ParseInt(fl[6], 10, 64)
			var length int64
			if fl[7] != "EOF" {
				end, _ := strconv.ParseInt(fl[7], 10, 64)
				length = end - start + 1
			}
			out = append(out, Lock{Fd: f.Fd, Write: fl[3] == "WRITE", Start: start, Len: length})
		}
	}
	return out, nil
}

// parseLockInode returns the inode number of /proc/locks' "MAJ:MIN:INO".
func parseLockInode(s string) (uint64, error) {
	p := strings.Split(s, ":")
	if len(p) != 3 {
		return 0, fmt.Errorf("/proc/locks: bad inode %q", s)
	}
	ino, err := strconv.ParseUint(p[2], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc/locks: bad inode %q: %w", s, err)
	}
	return ino, nil
}
