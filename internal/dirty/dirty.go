// Package dirty tells which pages of a process's memory it changed since the last look,
// so that a process brought back in place to an earlier state ("rewind in place", from a
// frozen copy-on-write copy of it) is given back only those pages.
//
// The kernels cairn runs on may lack soft-dirty bits (CONFIG_MEM_SOFT_DIRTY), so the
// tracking uses userfaultfd's asynchronous write-protect instead (Linux 6.7): the
// process's writable private memory is registered with a userfaultfd in write-protect
// mode, with UFFD_FEATURE_WP_ASYNC (a write to a protected page is let through by the
// kernel at once, which only drops the page's protection: no fault is ever delivered,
// so nobody has to read the userfaultfd) and UFFD_FEATURE_WP_UNPOPULATED (pages not yet
// populated are protected too, by markers in their page-table entries). The PAGEMAP_SCAN
// ioctl of /proc/<pid>/pagemap then finds the pages whose protection is gone and protects
// them again in one pass.
//
// The userfaultfd is created inside the process (by an injected call: a userfaultfd
// belongs to the memory of the process that creates it), taken into cairn with
// pidfd_getfd, and closed in the process again: the process's descriptor table is left
// as it was, and every later operation is cairn's own (the kernel applies a userfaultfd's
// ioctls to the memory it was created for, whoever calls them). Closing cairn's copy ends
// the tracking and unregisters the memory.
//
// What a Scan reports: every page whose content may differ from what it held at the
// previous Scan. That is a page written by the process or by the kernel on its behalf (a
// read(2) into it), a page whose content was dropped (MADV_DONTNEED: an anonymous page
// then reads as zeros, a page of a private file mapping as the file), and whole mappings
// that appeared, went or were mapped again. Some pages may be reported that did not
// change: a page written with the value it held, a private copy of a file page swapped
// out, a page dropped that held zeros. (A transparent huge page is split by the kernel
// at its first write, so that only the page written is reported.) The content of
// a private file mapping's pages that were never written is the file's, which the
// process does not own: writes to the file show through them untracked (the file
// system's rollback is what puts the file back).
//
// Lifecycle: Register, then Scan as often as wanted (each Scan's result is relative to
// the previous one's), then Close. A process that runs execve gets new memory: its
// Tracker's Scans fail from then on, and it must be registered again.
package dirty

import (
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"sync"
	"unsafe"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"golang.org/x/sys/unix"
)

const pageSize = 4096

// vecLen is how many regions one PAGEMAP_SCAN call reports at most; a scan with more
// goes on where the kernel stopped.
const vecLen = 512

// Tracker tracks the writes of one process.
type Tracker struct {
	pid int
	// uffd is cairn's copy of the userfaultfd made in the process; its ioctls apply to
	// the process's memory.
	uffd int
	// pagemap is the process's /proc/<pid>/pagemap, opened once: it names the memory the
	// process had then (an execve gives it new memory, which this file no longer reaches).
	pagemap *os.File

	mu sync.Mutex
	// areas are the writable private ranges tracked. Protected by mu.
	areas Set
	// private are the pages of the file-backed areas that held private copies of the
	// file (anonymous pages) at the last look: dropping one (MADV_DONTNEED) makes the page
	// read the file again and leaves a protection marker behind, which no later scan of
	// protections can tell from an untouched page. Protected by mu.
	private Set
	// vec receives PAGEMAP_SCAN's regions. Protected by mu.
	vec []pageRegion
	// err, once set, is returned by every Scan: after a failed scan the protections are
	// in an unknown state, and a later Scan could miss writes. Protected by mu.
	err error
	// closed is set by Close. Protected by mu.
	closed bool
}

// Supported says whether this kernel can track writes this way (probed once, on a
// scratch mapping of the calling process: UFFDIO_API with WP_ASYNC|WP_UNPOPULATED, a
// register, and a PAGEMAP_SCAN). The error says what is missing.
func Supported() error { return supported() }

var supported = sync.OnceValue(probe)

// probe tracks a scratch mapping of our own: protect it, write one page of two, and
// expect a scan to report exactly that page.
func probe() error {
	fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK|uffdUserModeOnly, 0, 0)
	switch {
	case errno == unix.ENOSYS:
		return errdefs.FailedPrecondition("write tracking: this kernel has no userfaultfd (CONFIG_USERFAULTFD)")
	case errno != 0:
		return errdefs.FailedPrecondition("write tracking: userfaultfd: %w", errno)
	}
	uffd := int(fd)
	defer unix.Close(uffd)
	if err := uffdAPIWPAsync(uffd); err != nil {
		return err
	}
	mem, err := unix.Mmap(-1, 0, 2*pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return fmt.Errorf("write tracking: scratch mapping: %w", err)
	}
	defer unix.Munmap(mem)
	start := uint64(uintptr(unsafe.Pointer(&mem[0])))
	r := Range{start, start + 2*pageSize}
	if err := registerWP(uffd, r); err != nil {
		return errdefs.FailedPrecondition("write tracking: register a scratch mapping: %w", err)
	}
	pagemap, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return fmt.Errorf("write tracking: %w", err)
	}
	defer pagemap.Close()
	t := &Tracker{pid: os.Getpid(), uffd: uffd, pagemap: pagemap, vec: make([]pageRegion, vecLen)}
	if _, err := t.written(r); err != nil {
		if errors.Is(err, unix.ENOTTY) {
			return errdefs.FailedPrecondition("write tracking: this kernel has no PAGEMAP_SCAN ioctl (Linux 6.7)")
		}
		return errdefs.FailedPrecondition("write tracking: %w", err)
	}
	mem[pageSize] = 1
	got, err := t.written(r)
	if err != nil {
		return errdefs.FailedPrecondition("write tracking: %w", err)
	}
	if want := (Set{{start + pageSize, r.End}}); len(got) != 1 || got[0] != want[0] {
		return errdefs.FailedPrecondition("write tracking: after a write to page 1 of a protected scratch mapping %v, PAGEMAP_SCAN reported %v written, not %v", r, got, want)
	}
	return nil
}

// uffdAPIWPAsync enables asynchronous write-protect, with markers for unpopulated pages,
// on a new userfaultfd.
func uffdAPIWPAsync(uffd int) error {
	const want = uffdFeatureWPAsync | uffdFeatureWPUnpopulated
	api := uffdioAPIArg{API: uffdAPI, Features: want}
	if _, err := ioctl(uffd, uffdioAPI, unsafe.Pointer(&api)); err != nil {
		if errors.Is(err, unix.EINVAL) {
			return errdefs.FailedPrecondition("write tracking: this kernel lacks userfaultfd's asynchronous write-protect (UFFD_FEATURE_WP_ASYNC and WP_UNPOPULATED, Linux 6.7, with CONFIG_PTE_MARKER_UFFD_WP)")
		}
		return fmt.Errorf("write tracking: UFFDIO_API: %w", err)
	}
	if api.Features&want != want {
		return errdefs.FailedPrecondition("write tracking: UFFDIO_API granted features %#x, without all of %#x", api.Features, want)
	}
	return nil
}

// Register makes a stopped process's writes trackable. p is a *ptrace.Tracee
// (github.com/cairn-sandbox/cairn/internal/ptrace) stopped by the caller (Wait returned),
// and Register is called on the tracer's thread (inside Tracer.Do).
//
// Every writable private mapping of the process is registered and protected; one that
// cannot be (a mapping the process registered with a userfaultfd of its own, say) fails
// Register, which then leaves nothing behind.
func Register(p *ptrace.Tracee) (*Tracker, error) {
	if err := Supported(); err != nil {
		return nil, err
	}
	uffd, err := takeUserfaultfd(p)
	if err != nil {
		return nil, err
	}
	t := &Tracker{pid: p.Pid, uffd: uffd, vec: make([]pageRegion, vecLen)}
	if err := t.start(); err != nil {
		t.Close() // unregisters whatever was registered
		return nil, err
	}
	return t, nil
}

func (t *Tracker) start() error {
	if err := uffdAPIWPAsync(t.uffd); err != nil {
		return err
	}
	f, err := os.Open("/proc/" + strconv.Itoa(t.pid) + "/pagemap")
	if err != nil {
		return fmt.Errorf("write tracking of process %d: %w", t.pid, err)
	}
	t.pagemap = f
	vmas, err := readMaps(t.pid)
	if err != nil {
		return err
	}
	areas, files := areasOf(vmas)
	for _, r := range areas {
		if err := t.track(r, vmas); err != nil {
			return err
		}
	}
	t.areas = areas
	t.private, err = t.privateCopies(files)
	return err
}

// takeUserfaultfd makes a userfaultfd in p and moves it into cairn: the descriptor p got
// is closed again, on every path. Should cairn die between the two injected calls, p
// keeps a userfaultfd with nothing registered (close-on-exec); should it die later, the
// release of its copy unregisters everything: p is never left with memory registered.
func takeUserfaultfd(p *ptrace.Tracee) (int, error) {
	fd, err := injectUserfaultfd(p)
	if err != nil {
		return -1, err
	}
	local, err := getfd(p.Pid, int(fd))
	if _, cerr := p.Syscall(unix.SYS_CLOSE, fd); cerr != nil {
		if err == nil {
			unix.Close(local)
		}
		return -1, errors.Join(err, fmt.Errorf("close the userfaultfd made in process %d (its fd %d): %w", p.Pid, fd, cerr))
	}
	return local, err
}

// injectUserfaultfd runs userfaultfd(2) in p with its seccomp filters suspended (a
// sandbox's filter refuses the call) for that one call.
func injectUserfaultfd(p *ptrace.Tracee) (fd uintptr, err error) {
	if err := p.SuspendSeccomp(true); err != nil {
		return 0, fmt.Errorf("write tracking of process %d: %w", p.Pid, err)
	}
	fd, err = p.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK|uffdUserModeOnly)
	if serr := p.SuspendSeccomp(false); serr != nil {
		if err == nil {
			p.Syscall(unix.SYS_CLOSE, fd)
		}
		return 0, errors.Join(err, fmt.Errorf("write tracking of process %d: %w", p.Pid, serr))
	}
	if err != nil {
		return 0, fmt.Errorf("userfaultfd in process %d: %w", p.Pid, err)
	}
	return fd, nil
}

// getfd duplicates descriptor fd of process pid into cairn (close-on-exec).
func getfd(pid, fd int) (int, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	local, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return -1, fmt.Errorf("pidfd_getfd of fd %d of process %d: %w", fd, pid, err)
	}
	return local, nil
}

// track registers r (writable private mappings of the process, end to end) and
// write-protects all of it, unpopulated pages included.
func (t *Tracker) track(r Range, vmas []vma) error {
	if err := registerWP(t.uffd, r); err != nil {
		return t.registerError(r, vmas, err)
	}
	if err := t.protect(r); err != nil {
		return fmt.Errorf("write tracking of process %d: protect %s: %w", t.pid, describe(vmas, r), err)
	}
	return nil
}

// registerError explains why r could not be registered: it names the first mapping of r
// that cannot be, and what it is.
func (t *Tracker) registerError(r Range, vmas []vma, err error) error {
	bad := r
	for _, v := range vmas {
		if v.End <= r.Start || v.Start >= r.End || !v.writablePrivate() {
			continue
		}
		if verr := registerWP(t.uffd, v.Range); verr != nil {
			bad, err = v.Range, verr
			break
		}
	}
	what := describe(vmas, bad)
	switch {
	case errors.Is(err, unix.EBUSY):
		return errdefs.FailedPrecondition("write tracking of process %d: its memory %s is registered with a userfaultfd of its own: %w", t.pid, what, err)
	case (errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EPERM)) && slices.Contains(vmFlags(t.pid, bad), "dp"):
		return errdefs.FailedPrecondition("write tracking of process %d: its memory %s is a droppable mapping (MAP_DROPPABLE, where glibc 2.41 and later keep getrandom's state), which no userfaultfd can register: %w", t.pid, what, err)
	case errors.Is(err, unix.EINVAL), errors.Is(err, unix.EPERM):
		return errdefs.FailedPrecondition("write tracking of process %d: its memory %s cannot be registered with a userfaultfd: %w", t.pid, what, err)
	}
	return fmt.Errorf("write tracking of process %d: register %s: %w", t.pid, what, err)
}

// registerWP registers r with uffd in write-protect mode (asynchronous, as UFFDIO_API
// made the userfaultfd). Registering memory registered already by the same userfaultfd
// changes nothing.
func registerWP(uffd int, r Range) error {
	reg := uffdioRegisterArg{Range: uffdioRange{Start: r.Start, Len: r.End - r.Start}, Mode: uffdioRegisterModeWP}
	if _, err := ioctl(uffd, uffdioRegister, unsafe.Pointer(&reg)); err != nil {
		return fmt.Errorf("UFFDIO_REGISTER %v: %w", r, err)
	}
	if reg.Ioctls&(1<<uffdioWriteprotectBit) == 0 {
		return fmt.Errorf("UFFDIO_REGISTER %v: write-protect not available there (ioctls %#x): %w", r, reg.Ioctls, unix.EINVAL)
	}
	return nil
}

// protect write-protects all of r; with WP_UNPOPULATED the kernel fills the page tables
// of unpopulated pages with markers, so that a page populated later shows as written.
func (t *Tracker) protect(r Range) error {
	wp := uffdioWriteprotectArg{Range: uffdioRange{Start: r.Start, Len: r.End - r.Start}, Mode: uffdioWriteprotectModeWP}
	if _, err := ioctl(t.uffd, uffdioWriteprotect, unsafe.Pointer(&wp)); err != nil {
		return fmt.Errorf("UFFDIO_WRITEPROTECT %v: %w", r, err)
	}
	return nil
}

// Scan returns the pages whose content may differ from what they held at the previous
// Scan (or at Register), and write-protects them again so that the next Scan starts
// from now. The process should be stopped (by anyone); Scan injects nothing.
//
// A failed Scan leaves the tracking incomplete: every later Scan fails too, and the
// process must be registered again (after Close).
func (t *Tracker) Scan() (Set, error) { return t.ScanMaps(nil) }

// ScanMaps is Scan for a process whose mappings the caller has just read (maps, of
// /proc/<pid>/maps), while it is stopped: it cannot have changed them since, and they
// are not read again. With maps nil it reads them.
func (t *Tracker) ScanMaps(maps []Mapping) (Set, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.closed:
		return nil, fmt.Errorf("write tracking of process %d: scan after Close", t.pid)
	case t.err != nil:
		return nil, fmt.Errorf("write tracking of process %d stopped at an earlier failed scan: %w", t.pid, t.err)
	}
	s, err := t.scan(maps)
	if err != nil {
		if t.memoryGone() {
			err = errdefs.FailedPrecondition("write tracking of process %d: the memory tracked is gone (the process exited, or ran execve: register it again): %w", t.pid, err)
		}
		t.err = err
		return nil, err
	}
	return s, nil
}

// memoryGone says whether the memory the tracking was set up for has been torn down
// (its process exited or ran execve). The pagemap file names that memory, whoever maps
// the PID now, and reads as empty once it is gone.
func (t *Tracker) memoryGone() bool {
	var b [8]byte
	n, err := t.pagemap.ReadAt(b[:], 0)
	return n == 0 && (err == nil || errors.Is(err, io.EOF))
}

// Preconditions: t.mu is held.
func (t *Tracker) scan(vmas []vma) (Set, error) {
	if t.memoryGone() {
		return nil, errors.New("no memory behind its pagemap")
	}
	if vmas == nil {
		var err error
		if vmas, err = readMaps(t.pid); err != nil {
			return nil, err
		}
	}
	areas, files := areasOf(vmas)
	kept := areas.Intersect(t.areas)
	added := areas.Subtract(t.areas)
	// Memory gone, or no longer writable and private: whatever is mapped there now (if
	// anything) is not what was.
	changed := t.areas.Subtract(areas).Union(added)
	for _, r := range added {
		if err := t.track(r, vmas); err != nil {
			return nil, err
		}
	}
	for _, r := range kept {
		d, err := t.changed(r, vmas)
		if err != nil {
			return nil, err
		}
		changed = changed.Union(d)
	}
	private, err := t.privateCopies(files)
	if err != nil {
		return nil, err
	}
	// Private copies of file pages since dropped (they read the file again), or swapped
	// out (which no category tells apart from a dropped page's marker).
	changed = changed.Union(t.private.Subtract(private).Intersect(kept))
	t.areas, t.private = areas, private
	return changed, nil
}

// changed scans r, an area tracked since the last look, and protects it again.
//
// Preconditions: t.mu is held.
func (t *Tracker) changed(r Range, vmas []vma) (Set, error) {
	// Mappings of r that are not registered were unmapped and mapped again, looking the
	// same in the maps file: track them afresh, all of them changed.
	fresh, err := t.unregistered(r)
	if err != nil {
		return nil, err
	}
	for _, u := range fresh {
		if err := t.track(u, vmas); err != nil {
			return nil, err
		}
	}
	w, err := t.written(r)
	if errors.Is(err, unix.EPERM) {
		// Still a mapping not registered (only if the process is not stopped: it mapped
		// one since): all of r, afresh.
		if err := t.track(r, vmas); err != nil {
			return nil, err
		}
		return Set{r}, nil
	}
	if err != nil {
		return nil, err
	}
	z, err := t.zapped(r)
	if err != nil {
		return nil, err
	}
	return fresh.Union(w).Union(z), nil
}

// unregistered returns the pages of r in mappings without asynchronous write-protect.
// The kernel decides that per mapping before walking its page tables, and walks only
// those that match: in the usual case (all registered) this walks nothing.
//
// Preconditions: t.mu is held.
func (t *Tracker) unregistered(r Range) (Set, error) {
	return t.pagemapScan(r, pmScanArg{
		CategoryInverted: pageIsWPAllowed,
		CategoryMask:     pageIsWPAllowed,
		ReturnMask:       pageIsWPAllowed,
	})
}

// written returns the pages of r written since they were protected, and protects them
// again. It fails with EPERM if a mapping in r is not registered with asynchronous
// write-protect (PM_SCAN_CHECK_WPASYNC).
//
// Preconditions: t.mu is held (or t is not shared).
func (t *Tracker) written(r Range) (Set, error) {
	return t.pagemapScan(r, pmScanArg{
		Flags:             pmScanWPMatching | pmScanCheckWPAsync,
		CategoryAnyofMask: pageIsWritten,
		ReturnMask:        pageIsWritten,
	})
}

// zapped returns the pages of r whose content was dropped since they were protected,
// and protects them again (markers). After a protect every page-table entry of r is a
// protected page (present, or swapped out) or a marker, which the kernel counts as
// swapped; a MADV_DONTNEED of anonymous memory clears the entry, marker included, and
// the kernel may free a page table left empty, so an entry neither present nor swapped,
// or a hole without a page table, is a page dropped since.
//
// Preconditions: t.mu is held.
func (t *Tracker) zapped(r Range) (Set, error) {
	return t.pagemapScan(r, pmScanArg{
		Flags:            pmScanWPMatching | pmScanCheckWPAsync,
		CategoryInverted: pageIsPresent | pageIsSwapped,
		CategoryMask:     pageIsPresent | pageIsSwapped,
		ReturnMask:       pageIsPresent | pageIsSwapped,
	})
}

// privateCopies returns the pages of files (file-backed areas) that are private copies:
// present, and neither a page of the file nor the zero page.
//
// Preconditions: t.mu is held (or t is not shared).
func (t *Tracker) privateCopies(files Set) (Set, error) {
	var out Set
	for _, r := range files {
		s, err := t.pagemapScan(r, pmScanArg{
			CategoryInverted: pageIsFile | pageIsPFNZero,
			CategoryMask:     pageIsPresent | pageIsFile | pageIsPFNZero,
			ReturnMask:       pageIsPresent,
		})
		if err != nil {
			return nil, err
		}
		out = append(out, s...)
	}
	return normalise(out), nil
}

// pagemapScan runs PAGEMAP_SCAN over r with the masks and flags of a, as many times as
// the output vector needs (the kernel stops when it is full and says where, in walk_end;
// pages past that point are left as they were, unprotected ones included).
//
// Preconditions: t.mu is held (or t is not shared).
func (t *Tracker) pagemapScan(r Range, a pmScanArg) (Set, error) {
	var out Set
	for start := r.Start; start < r.End; {
		a.Size = uint64(unsafe.Sizeof(a))
		a.Start, a.End, a.WalkEnd = start, r.End, 0
		a.Vec, a.VecLen, a.MaxPages = uint64(uintptr(unsafe.Pointer(&t.vec[0]))), uint64(len(t.vec)), 0
		n, err := ioctl(int(t.pagemap.Fd()), pagemapScan, unsafe.Pointer(&a))
		if err != nil {
			return nil, fmt.Errorf("PAGEMAP_SCAN of process %d over %v: %w", t.pid, Range{start, r.End}, err)
		}
		if n > uintptr(len(t.vec)) {
			return nil, fmt.Errorf("PAGEMAP_SCAN of process %d over %v: %d regions reported, room for %d", t.pid, Range{start, r.End}, n, len(t.vec))
		}
		for _, pr := range t.vec[:n] {
			out = append(out, Range{pr.Start, pr.End})
		}
		if a.WalkEnd <= start || a.WalkEnd > r.End {
			return nil, fmt.Errorf("PAGEMAP_SCAN of process %d over %v: the walk ended at %#x", t.pid, Range{start, r.End}, a.WalkEnd)
		}
		start = a.WalkEnd
	}
	return normalise(out), nil
}

// ioctl runs ioctl(2). It is not retried on EINTR: PAGEMAP_SCAN, interrupted, may have
// protected pages already, whose report would be lost.
func ioctl(fd int, req uintptr, arg unsafe.Pointer) (uintptr, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if errno != 0 {
		return 0, errno
	}
	return r, nil
}

// Areas are the writable private ranges tracked, as of the last Scan/Register.
func (t *Tracker) Areas() Set {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append(Set(nil), t.areas...)
}

// Close ends the tracking (closes cairn's userfaultfd, which unregisters the process's ranges).
func (t *Tracker) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	// The kernel clears the protections when the last reference to the userfaultfd goes
	// (markers left in page tables are dropped when next touched).
	err := unix.Close(t.uffd)
	if t.pagemap != nil {
		err = errors.Join(err, t.pagemap.Close())
	}
	if err != nil {
		return fmt.Errorf("end the write tracking of process %d: %w", t.pid, err)
	}
	return nil
}
