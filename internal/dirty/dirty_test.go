package dirty

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/cairn-sandbox/cairn/internal/ptrace"
	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// Advice values of madvise(2).
const (
	madvDontneed   = 4
	madvHugepage   = 14
	madvNohugepage = 15
)

// fixture is a replica with two test mappings: 16 MiB of anonymous memory, the first
// half written before tracking starts and the second never touched, and a private
// mapping of a 64-page file, pages 0-15 read (file pages mapped) and 16-31 written
// (private copies) before tracking starts.
type fixture struct {
	r    *replica
	tr   *ptrace.Tracer
	tk   *Tracker
	anon Range
	file Range
	path string // the mapped file; also a page of data for sysread
}

const (
	anonPages = 4096
	filePages = 64
)

func newFixture(t *testing.T, filtered bool) *fixture {
	t.Helper()
	f := &fixture{r: startReplica(t, filtered)}
	f.tr = ptrace.NewTracer()
	t.Cleanup(f.tr.Close)
	// No transparent huge pages (unless a test asks for them): a kernel may report a
	// write to one as all of its 2 MiB (this one splits it and reports the page).
	a := addr(t, f.r.do(t, "map %x 0", anonPages*pageSize))
	f.anon = Range{a, a + anonPages*pageSize}
	f.r.do(t, "madvise %x %x %x", a, anonPages*pageSize, madvNohugepage)
	f.r.do(t, "fill %x %x", a, anonPages/2*pageSize)

	f.path = filepath.Join(t.TempDir(), "mapped")
	if err := os.WriteFile(f.path, []byte(strings.Repeat("F", filePages*pageSize)), 0o644); err != nil {
		t.Fatal(err)
	}
	a = addr(t, f.r.do(t, "map %x 0 %s", filePages*pageSize, f.path))
	f.file = Range{a, a + filePages*pageSize}
	f.r.do(t, "madvise %x %x %x", a, filePages*pageSize, madvNohugepage)
	f.r.do(t, "touch %s", pageList(f.file, 0, 16))
	f.r.do(t, "write %s", pageList(f.file, 16, 32))
	return f
}

// register starts tracking the replica.
func (f *fixture) register(t *testing.T) {
	t.Helper()
	t.Cleanup(f.close)
	stopped(t, f.tr, f.r.pid, func(p *ptrace.Tracee) (err error) {
		f.tk, err = Register(p)
		return err
	})
}

// close ends the tracking, if any.
func (f *fixture) close() {
	if f.tk != nil {
		f.tk.Close()
	}
}

// scan stops the replica and scans it.
func (f *fixture) scan(t *testing.T) Set {
	t.Helper()
	var s Set
	stopped(t, f.tr, f.r.pid, func(*ptrace.Tracee) (err error) {
		s, err = f.tk.Scan()
		return err
	})
	return s
}

// expect checks the scan result within the test mappings (and extra ranges).
func (f *fixture) expect(t *testing.T, what string, got, want Set, extra ...Range) {
	t.Helper()
	in := Set{f.anon, f.file}.Union(extra)
	if diff := cmp.Diff(want.Union(nil), got.Intersect(in)); diff != "" {
		t.Errorf("%s: changed pages of the test mappings (-want +got):\n%s", what, diff)
	}
}

// page is page i of r.
func page(r Range, i int) Range {
	s := r.Start + uint64(i)*pageSize
	return Range{s, s + pageSize}
}

// pages is the set of pages i of r.
func pages(r Range, is ...int) Set {
	var s Set
	for _, i := range is {
		s = append(s, page(r, i))
	}
	return s.Union(nil)
}

// pageList is the addresses of pages [from, to) of r, for a replica command.
func pageList(r Range, from, to int) string {
	var b strings.Builder
	for i := from; i < to; i++ {
		fmt.Fprintf(&b, " %x", page(r, i).Start)
	}
	return b.String()
}

// at is the address of page i of r, for a replica command.
func at(r Range, i int) string { return fmt.Sprintf("%x", page(r, i).Start) }

// categoryNames name PAGE_IS_* bits in test logs.
var categoryNames = []string{"wpallowed", "written", "file", "present", "swapped", "pfnzero", "huge"}

func categoryString(c uint64) string {
	var out []string
	for i, n := range categoryNames {
		if c&(1<<i) != 0 {
			out = append(out, n)
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, "|")
}

// categories returns the PAGEMAP_SCAN categories of each page of r in process pid,
// looking only (no protect).
func categories(t *testing.T, pid int, r Range) []pageRegion {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/pagemap", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	vec := make([]pageRegion, 4096)
	var out []pageRegion
	for start := r.Start; start < r.End; {
		a := pmScanArg{Start: start, End: r.End, Vec: uint64(uintptr(unsafe.Pointer(&vec[0]))), VecLen: uint64(len(vec)),
			ReturnMask: pageIsWPAllowed | pageIsWritten | pageIsFile | pageIsPresent | pageIsSwapped | pageIsPFNZero | pageIsHuge}
		a.Size = uint64(unsafe.Sizeof(a))
		n, err := ioctl(int(f.Fd()), pagemapScan, unsafe.Pointer(&a))
		if err != nil {
			t.Fatalf("PAGEMAP_SCAN %v: %v", r, err)
		}
		runtime.KeepAlive(vec)
		out = append(out, vec[:n]...)
		start = a.WalkEnd
	}
	return out
}

// categoryOf is the categories of the page at a, from categories' answer.
func categoryOf(regions []pageRegion, a uint64) (uint64, bool) {
	for _, pr := range regions {
		if pr.Start <= a && a < pr.End {
			return pr.Categories, true
		}
	}
	return 0, false
}

// TestKernelCategories records how this kernel categorises the page-table entries the
// tracking relies on: after a protect, a page never touched is a marker, which
// PAGEMAP_SCAN counts as swapped and not written; a MADV_DONTNEED of anonymous memory
// leaves an entry neither present nor swapped (which kernels with the fix "PAGEMAP_SCAN
// written state for unpopulated PTEs" also count as written, older ones not); one of a
// private file mapping's page leaves a marker, even where the page was a private copy
// (which is why privateCopies exists).
func TestKernelCategories(t *testing.T) {
	// emptyEntry: neither present nor swapped, written or not. markerOrMapped: a marker,
	// or a page of the file mapped, protected, when a fault next to it mapped a large
	// folio of the file's cache (which the kernel may do for a read fault). zeroOrFresh:
	// the zero page, or a page of its own where the kernel maps none for a read fault
	// (some hypervisors' guests: pvm_no_zero_page=1); not written either way.
	const emptyEntry, markerOrMapped, zeroOrFresh = 1 << 63, 1 << 62, 1 << 61
	f := newFixture(t, false)
	f.register(t)
	f.r.do(t, "write %s %s %s", at(f.anon, 1), at(f.anon, 3000), at(f.file, 40))
	f.r.do(t, "touch %s %s", at(f.anon, 3001), at(f.file, 41))
	f.r.do(t, "madvise %s %x %x", at(f.anon, 2), pageSize, madvDontneed)
	f.r.do(t, "madvise %s %x %x", at(f.anon, 3002), pageSize, madvDontneed)
	f.r.do(t, "madvise %s %x %x", at(f.file, 3), pageSize, madvDontneed)
	f.r.do(t, "madvise %s %x %x", at(f.file, 17), pageSize, madvDontneed)
	var anon, file []pageRegion
	stopped(t, f.tr, f.r.pid, func(*ptrace.Tracee) error {
		anon, file = categories(t, f.r.pid, f.anon), categories(t, f.r.pid, f.file)
		return nil
	})
	cases := []struct {
		what string
		in   []pageRegion
		r    Range
		want uint64 // without wpallowed, which every page has; or emptyEntry
	}{
		{"anonymous page populated before, untouched since", anon, page(f.anon, 0), pageIsPresent},
		{"anonymous page populated before, written since", anon, page(f.anon, 1), pageIsPresent | pageIsWritten},
		{"anonymous page populated before, dropped since", anon, page(f.anon, 2), emptyEntry},
		{"anonymous page never touched (marker)", anon, page(f.anon, 2999), pageIsSwapped},
		{"anonymous page first written since", anon, page(f.anon, 3000), pageIsPresent | pageIsWritten},
		{"anonymous page first read since", anon, page(f.anon, 3001), zeroOrFresh},
		{"anonymous marker dropped", anon, page(f.anon, 3002), emptyEntry},
		{"file page read before, untouched since", file, page(f.file, 0), pageIsPresent | pageIsFile},
		{"file page read before, dropped since", file, page(f.file, 3), pageIsSwapped},
		{"private copy made before, untouched since", file, page(f.file, 16), pageIsPresent},
		{"private copy made before, dropped since", file, page(f.file, 17), pageIsSwapped},
		{"file page never touched (marker)", file, page(f.file, 39), markerOrMapped},
		{"file page first written since", file, page(f.file, 40), pageIsPresent | pageIsWritten},
		{"file page first read since", file, page(f.file, 41), pageIsPresent | pageIsFile},
	}
	for _, c := range cases {
		got, ok := categoryOf(c.in, c.r.Start)
		t.Logf("%-50s %s", c.what, categoryString(got))
		if !ok {
			t.Errorf("%s: page %v not reported by PAGEMAP_SCAN", c.what, c.r)
			continue
		}
		if got&pageIsWPAllowed == 0 {
			t.Errorf("%s: page %v is in a mapping not registered (categories %s)", c.what, c.r, categoryString(got))
		}
		got &^= pageIsWPAllowed
		if c.want == emptyEntry && got&(pageIsPresent|pageIsSwapped) == 0 {
			continue
		}
		if c.want == markerOrMapped && (got == pageIsSwapped || got == pageIsPresent|pageIsFile) {
			continue
		}
		if c.want == zeroOrFresh && (got == pageIsPresent|pageIsPFNZero || got == pageIsPresent) {
			continue
		}
		if got != c.want {
			want := categoryString(c.want)
			switch c.want {
			case emptyEntry:
				want = "neither present nor swapped"
			case markerOrMapped:
				want = "swapped, or present|file"
			case zeroOrFresh:
				want = "present|pfnzero, or present"
			}
			t.Errorf("%s: categories %s, want %s", c.what, categoryString(got), want)
		}
	}
}

// TestNothingWritten: a process that ran without changing the test mappings has none
// of their pages reported, at the first Scan and at a second one right after it.
func TestNothingWritten(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	f.r.do(t, "touch %s %s %s", at(f.anon, 0), at(f.anon, 3000), at(f.file, 50))
	f.expect(t, "first scan", f.scan(t), nil)
	f.expect(t, "second scan", f.scan(t), nil)
	test := Set{f.anon, f.file}.Union(nil)
	if diff := cmp.Diff(test, f.tk.Areas().Intersect(test)); diff != "" {
		t.Errorf("areas tracked, within the test mappings (-want +got):\n%s", diff)
	}
}

// TestWrites: pages written by the process, populated before or not, anonymous or
// mapping a file, are reported once; a second Scan right after reports nothing; a page
// written again is reported again.
func TestWrites(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	f.r.do(t, "write %s %s %s %s", at(f.anon, 1), at(f.anon, 2), at(f.anon, 3000), at(f.anon, 4095))
	f.r.do(t, "write %s %s %s", at(f.file, 5), at(f.file, 20), at(f.file, 40))
	want := pages(f.anon, 1, 2, 3000, 4095).Union(pages(f.file, 5, 20, 40))
	f.expect(t, "after writes", f.scan(t), want)
	f.expect(t, "scan right after", f.scan(t), nil)
	f.r.do(t, "write %s", at(f.anon, 2))
	f.expect(t, "after a write again", f.scan(t), pages(f.anon, 2))
}

// TestKernelWrite: a page the kernel writes for the process (read(2) into it, a write
// in kernel mode) is reported.
func TestKernelWrite(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	for _, p := range []Range{page(f.anon, 10), page(f.anon, 3500), page(f.file, 6), page(f.file, 45)} {
		f.r.do(t, "sysread %x %s", p.Start, f.path)
	}
	f.expect(t, "after read(2)", f.scan(t), pages(f.anon, 10, 3500).Union(pages(f.file, 6, 45)))
}

// TestDontneed: pages whose content MADV_DONTNEED dropped are reported (anonymous pages
// read as zeros after it, those of a private file mapping as the file), whether written
// since the last Scan or before it; a dropped page of the file, unchanged, is not.
func TestDontneed(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	// Written before the first Scan, dropped after it.
	f.r.do(t, "write %s %s", at(f.anon, 30), at(f.file, 8))
	f.expect(t, "after writes", f.scan(t), pages(f.anon, 30).Union(pages(f.file, 8)))
	drop := func(r Range, i int) { f.r.do(t, "madvise %s %x %x", at(r, i), pageSize, madvDontneed) }
	f.r.do(t, "write %s %s", at(f.anon, 1), at(f.file, 7))
	drop(f.anon, 1)  // written, then dropped
	drop(f.anon, 2)  // populated before tracking, never written
	drop(f.anon, 30) // written in the previous round
	drop(f.file, 7)  // a file page written (a private copy), then dropped
	drop(f.file, 8)  // the private copy of the previous round
	drop(f.file, 17) // a private copy made before tracking
	drop(f.file, 3)  // a page of the file, unchanged: it reads the same
	want := pages(f.anon, 1, 2, 30).Union(pages(f.file, 7, 8, 17))
	f.expect(t, "after MADV_DONTNEED", f.scan(t), want)
	f.expect(t, "scan right after", f.scan(t), nil)
	// Dropped pages are tracked again: written, they are reported.
	f.r.do(t, "write %s %s", at(f.anon, 2), at(f.file, 17))
	f.expect(t, "after writes to dropped pages", f.scan(t), pages(f.anon, 2).Union(pages(f.file, 17)))
}

// TestDontneedWholeTable drops a populated, page-table-aligned 2 MiB: the kernel may free
// the page table (a hole, no entries at all), and all of it is reported either way.
func TestDontneedWholeTable(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	const table = 2 << 20
	start := (f.anon.Start + table - 1) &^ (table - 1)
	r := Range{start, start + table}
	if r.End > f.anon.Start+anonPages/2*pageSize {
		t.Fatalf("no populated page table in %v", f.anon)
	}
	before := vmPTE(t, f.r.pid)
	f.r.do(t, "madvise %x %x %x", r.Start, table, madvDontneed)
	t.Logf("VmPTE %s before MADV_DONTNEED of %v, %s after", before, r, vmPTE(t, f.r.pid))
	f.expect(t, "after MADV_DONTNEED of 2 MiB", f.scan(t), Set{r})
	f.expect(t, "scan right after", f.scan(t), nil)
}

// vmPTE is the size of the process's page tables.
func vmPTE(t *testing.T, pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmPTE:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// TestMappingsChange: memory unmapped is reported; memory unmapped and mapped again at
// the same address (the maps file looks the same) is reported whole and tracked again;
// a new mapping is reported whole and tracked.
func TestMappingsChange(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	gone := Range{page(f.anon, 100).Start, page(f.anon, 110).Start}
	again := Range{page(f.anon, 200).Start, page(f.anon, 210).Start}
	f.r.do(t, "unmap %x %x", gone.Start, gone.End-gone.Start)
	f.r.do(t, "unmap %x %x", again.Start, again.End-again.Start)
	f.r.do(t, "map %x %x", again.End-again.Start, again.Start)
	n := addr(t, f.r.do(t, "map %x 0", 256*pageSize))
	fresh := Range{n, n + 256*pageSize}
	f.r.do(t, "madvise %x %x %x", n, 256*pageSize, madvNohugepage)
	f.expect(t, "after unmap, map again, map", f.scan(t), Set{gone, again, fresh}, fresh)
	if got := f.tk.Areas().Intersect(Set{gone}); got != nil {
		t.Errorf("unmapped %v still tracked: %v", gone, got)
	}
	if diff := cmp.Diff(Set{again, fresh}.Union(nil), f.tk.Areas().Intersect(Set{again, fresh})); diff != "" {
		t.Errorf("mapped memory tracked (-want +got):\n%s", diff)
	}
	f.expect(t, "scan right after", f.scan(t), nil, fresh)
	f.r.do(t, "write %s %s %s", at(again, 5), at(fresh, 7), at(f.anon, 300))
	f.expect(t, "after writes", f.scan(t), pages(again, 5).Union(pages(fresh, 7)).Union(pages(f.anon, 300)), fresh)
}

// TestDescriptorsUntouched: Register leaves the process's descriptor table as it was.
func TestDescriptorsUntouched(t *testing.T) {
	f := newFixture(t, false)
	before := descriptors(t, f.r.pid)
	f.register(t)
	if diff := cmp.Diff(before, descriptors(t, f.r.pid)); diff != "" {
		t.Errorf("descriptors of the process (-before +after Register):\n%s", diff)
	}
}

// descriptors lists /proc/<pid>/fd: each descriptor and what it refers to.
func descriptors(t *testing.T, pid int) map[string]string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out[e.Name()] = target
	}
	return out
}

// TestRemoteRegister: the ioctls cairn makes on its copy of the userfaultfd apply to
// the process's memory (ctx->mm), not cairn's: the process's mappings are registered
// (smaps VmFlags "uw"), and no longer once the tracking is closed.
func TestRemoteRegister(t *testing.T) {
	f := newFixture(t, false)
	if uw := uffdWP(t, f.r.pid, f.anon.Start); uw {
		t.Fatal("test mapping registered before Register")
	}
	f.register(t)
	if !uffdWP(t, f.r.pid, f.anon.Start) || !uffdWP(t, f.r.pid, f.file.Start) {
		t.Fatal("test mappings not registered by Register")
	}
	if uffdWP(t, os.Getpid(), 0) {
		t.Error("a mapping of the test process itself is registered")
	}
	if err := f.tk.Close(); err != nil {
		t.Fatal(err)
	}
	if uffdWP(t, f.r.pid, f.anon.Start) || uffdWP(t, f.r.pid, f.file.Start) {
		t.Error("test mappings still registered after Close")
	}
	if _, err := f.tk.Scan(); err == nil {
		t.Error("Scan after Close succeeded")
	}
}

// uffdWP says whether the mapping of pid at a is registered for userfaultfd
// write-protect (VmFlags "uw" in smaps); at 0, whether any is.
func uffdWP(t *testing.T, pid int, a uint64) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	in := a == 0
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			var s, e uint64
			fmt.Sscanf(f[0], "%x-%x", &s, &e)
			in = a == 0 || (s <= a && a < e)
			continue
		}
		if v, ok := strings.CutPrefix(l, "VmFlags:"); ok && in {
			for _, fl := range strings.Fields(v) {
				if fl == "uw" {
					return true
				}
			}
		}
	}
	return false
}

// TestForkedChild: a child the process forks after Register is not tracked, and can
// write its memory (the protections it inherits are dropped); its writes are not the
// parent's, and the parent's are still tracked.
func TestForkedChild(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	f.r.do(t, "write %s", at(f.anon, 5))
	f.expect(t, "before the fork", f.scan(t), pages(f.anon, 5))
	// The child writes populated, written-since, never-touched and file pages.
	child := f.r.do(t, "fork %s %s %s %s %s", at(f.anon, 1), at(f.anon, 5), at(f.anon, 3000), at(f.file, 3), at(f.file, 40))[0]
	var cpid int
	fmt.Sscan(child, &cpid)
	if uffdWP(t, cpid, 0) {
		t.Error("the forked child has mappings registered for write-protect")
	}
	if !uffdWP(t, f.r.pid, f.anon.Start) {
		t.Error("the parent's test mapping is no longer registered after its fork")
	}
	if err := unix.Kill(cpid, unix.SIGCONT); err != nil {
		t.Fatal(err)
	}
	if got := f.r.do(t, "reap %d", cpid); got[0] != "0" {
		t.Fatalf("the forked child could not write its memory: exit status %v", got)
	}
	f.expect(t, "after the child's writes", f.scan(t), nil)
	if got := f.r.do(t, "get %s", at(f.anon, 5)); got[0] == "90" {
		t.Error("the child's write shows in the parent's memory")
	}
	f.r.do(t, "write %s %s", at(f.anon, 1), at(f.file, 3))
	f.expect(t, "after the parent's writes", f.scan(t), pages(f.anon, 1).Union(pages(f.file, 3)))
}

// TestSeccompFiltered: Register works on a process under the sandbox's seccomp filter,
// which refuses userfaultfd, and leaves the filter in force: at once (an injected call
// is refused again, the process still attached) and after the detach.
func TestSeccompFiltered(t *testing.T) {
	f := newFixture(t, true)
	if got := f.r.try(t, "uffd"); len(got) < 3 || got[0] != "error" || got[2] != "Operation_not_permitted" {
		t.Fatalf("userfaultfd in the filtered replica: %v, want EPERM", got)
	}
	t.Cleanup(f.close)
	stopped(t, f.tr, f.r.pid, func(p *ptrace.Tracee) (err error) {
		if f.tk, err = Register(p); err != nil {
			return err
		}
		if fd, err := p.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|uffdUserModeOnly); err != unix.EPERM {
			p.Syscall(unix.SYS_CLOSE, fd)
			return fmt.Errorf("userfaultfd injected after Register: %v, want EPERM (seccomp suspended still?)", err)
		}
		return nil
	})
	f.r.do(t, "write %s %s", at(f.anon, 3), at(f.file, 33))
	f.expect(t, "after writes", f.scan(t), pages(f.anon, 3).Union(pages(f.file, 33)))
	if got := f.r.try(t, "uffd"); len(got) < 3 || got[2] != "Operation_not_permitted" {
		t.Fatalf("userfaultfd in the filtered replica after Register: %v, want EPERM still", got)
	}
}

// TestOwnUserfaultfd: a process that registered memory with a userfaultfd of its own
// cannot be tracked; Register says why and leaves nothing behind.
func TestOwnUserfaultfd(t *testing.T) {
	f := newFixture(t, false)
	// Missing-page mode, which anonymous memory supports.
	own := addr(t, f.r.do(t, "map %x 0", 64*pageSize))
	fd := f.r.do(t, "uffd %x %x", own, 64*pageSize)[0]
	before := descriptors(t, f.r.pid)
	var err error
	stopped(t, f.tr, f.r.pid, func(p *ptrace.Tracee) error {
		_, err = Register(p)
		return nil
	})
	if err == nil {
		t.Fatal("Register succeeded on a process with memory registered with its own userfaultfd")
	}
	t.Logf("Register: %v", err)
	if !strings.Contains(err.Error(), "userfaultfd of its own") {
		t.Errorf("Register's error does not say why: %v", err)
	}
	if diff := cmp.Diff(before, descriptors(t, f.r.pid)); diff != "" {
		t.Errorf("descriptors of the process (-before +after Register):\n%s", diff)
	}
	if uffdWP(t, f.r.pid, 0) {
		t.Error("a mapping is left registered for write-protect after Register failed")
	}
	if _, ok := before[fd]; !ok {
		t.Errorf("the process's own userfaultfd %s is not among its descriptors %v", fd, before)
	}
}

// TestHugePages: transparent huge pages are protected whole (one page-table entry each);
// a write reports its page and at most the rest of its huge page (this kernel splits the
// huge page at the write and reports the page alone); a huge page dropped whole (its
// entry cleared, no page table below it) is reported, and so is a page dropped from one.
func TestHugePages(t *testing.T) {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil || strings.Contains(string(b), "[never]") {
		t.Skip("transparent huge pages are off")
	}
	f := newFixture(t, false)
	const huge = 2 << 20
	a := addr(t, f.r.do(t, "map %x 0", 5*huge))
	r := Range{(a + huge - 1) &^ (huge - 1), 0}
	r.End = r.Start + 4*huge
	f.r.do(t, "madvise %x %x %x", r.Start, r.End-r.Start, madvHugepage)
	f.r.do(t, "fill %x %x", r.Start, r.End-r.Start)
	if !huge2M(t, f.r.pid, r.Start) {
		t.Skip("the kernel gave no huge page")
	}
	f.register(t)
	var cats []pageRegion
	stopped(t, f.tr, f.r.pid, func(*ptrace.Tracee) error { cats = categories(t, f.r.pid, r); return nil })
	for _, c := range cats {
		t.Logf("after Register: %v %s", Range{c.Start, c.End}, categoryString(c.Categories))
	}
	f.r.do(t, "write %s", at(r, 1))
	f.r.do(t, "madvise %x %x %x", r.Start+2*huge, huge, madvDontneed)
	f.r.do(t, "madvise %s %x %x", at(r, 3*512+7), pageSize, madvDontneed)
	got := f.scan(t).Intersect(Set{r})
	t.Logf("write to page 1, drop of the third huge page and of a page of the fourth: %v reported", got)
	for _, must := range []Set{pages(r, 1), {{r.Start + 2*huge, r.Start + 3*huge}}, pages(r, 3*512+7)} {
		if must.Subtract(got) != nil {
			t.Errorf("changed pages %v not reported", must)
		}
	}
	may := Set{{r.Start, r.Start + huge}, {r.Start + 2*huge, r.End}}
	if extra := got.Subtract(may); extra != nil {
		t.Errorf("pages of huge pages not changed reported: %v", extra)
	}
	f.expect(t, "scan right after", f.scan(t), nil, r)
}

// huge2M says whether the anonymous memory at a is (in) a transparent huge page.
func huge2M(t *testing.T, pid int, a uint64) bool {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 0 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			var s, e uint64
			fmt.Sscanf(f[0], "%x-%x", &s, &e)
			in = s <= a && a < e
			continue
		}
		if v, ok := strings.CutPrefix(l, "AnonHugePages:"); ok && in {
			return strings.TrimSpace(v) != "0 kB"
		}
	}
	return false
}

// TestDurations logs what Register and Scan cost on a process with 64 MiB of populated
// memory (for information: no assertion on time).
func TestDurations(t *testing.T) {
	f := newFixture(t, false)
	const size = 64 << 20
	a := addr(t, f.r.do(t, "map %x 0", size))
	big := Range{a, a + size}
	f.r.do(t, "madvise %x %x %x", a, size, madvNohugepage)
	f.r.do(t, "fill %x %x", a, size)
	start := time.Now()
	if err := Supported(); err != nil {
		t.Fatal(err)
	}
	t.Logf("Supported (probed once a process, or cached): %v", time.Since(start))
	var took time.Duration
	timed := func(fn func() error) func(*ptrace.Tracee) error {
		return func(*ptrace.Tracee) error {
			start := time.Now()
			err := fn()
			took = time.Since(start)
			return err
		}
	}
	t.Cleanup(f.close)
	stopped(t, f.tr, f.r.pid, func(p *ptrace.Tracee) error {
		start := time.Now()
		var err error
		f.tk, err = Register(p)
		took = time.Since(start)
		return err
	})
	t.Logf("Register: %v (%d areas, %d MiB)", took, len(f.tk.Areas()), f.tk.Areas().Bytes()>>20)
	var s Set
	stopped(t, f.tr, f.r.pid, timed(func() (err error) { s, err = f.tk.Scan(); return err }))
	t.Logf("Scan, nothing written: %v (%d KiB reported)", took, s.Bytes()>>10)
	var b strings.Builder
	for i := 0; i < 500; i++ {
		fmt.Fprintf(&b, " %s", at(big, i*31))
	}
	f.r.do(t, "write%s", b.String())
	stopped(t, f.tr, f.r.pid, timed(func() (err error) { s, err = f.tk.Scan(); return err }))
	t.Logf("Scan, 500 pages written: %v (%d KiB reported, %d in the test mapping)", took, s.Bytes()>>10, s.Intersect(Set{big}).Bytes()>>12)
	if got := s.Intersect(Set{big}).Bytes() / pageSize; got != 500 {
		t.Errorf("%d pages of the test mapping reported, want the 500 written", got)
	}
}

// TestDroppable: a droppable mapping (MAP_DROPPABLE, which glibc 2.41 and later use for
// getrandom's state) cannot be registered: Register fails, saying so.
func TestDroppable(t *testing.T) {
	f := newFixture(t, false)
	const mapDroppable, mapAnonymous = 0x08, 0x20
	got := f.r.try(t, "mapflags %x %x", 16*pageSize, mapDroppable|mapAnonymous)
	if got[0] == "error" {
		prereq.Missing(t, fmt.Sprintf("this kernel has no MAP_DROPPABLE (Linux 6.11): %v", got))
	}
	var err error
	stopped(t, f.tr, f.r.pid, func(p *ptrace.Tracee) error {
		_, err = Register(p)
		return nil
	})
	t.Logf("Register: %v", err)
	if err == nil || !strings.Contains(err.Error(), "droppable") || !strings.Contains(err.Error(), got[0]+"-") {
		t.Fatalf("Register: %v, want an error naming the droppable mapping at %s", err, got[0])
	}
	if uffdWP(t, f.r.pid, 0) {
		t.Error("a mapping is left registered for write-protect after Register failed")
	}
}

// TestExecve: a process that runs execve has new memory, which the tracking does not
// reach: Scan fails, saying so, and goes on failing.
func TestExecve(t *testing.T) {
	f := newFixture(t, false)
	f.register(t)
	f.r.do(t, "exec")
	waitExec(t, f.r.pid, "execd")
	var err error
	for i := 0; i < 2; i++ {
		stopped(t, f.tr, f.r.pid, func(*ptrace.Tracee) error {
			_, err = f.tk.Scan()
			return nil
		})
		t.Logf("Scan %d after execve: %v", i+1, err)
		if err == nil || !strings.Contains(err.Error(), "execve") {
			t.Fatalf("Scan %d after execve: %v, want an error saying the memory is gone", i+1, err)
		}
	}
}

// waitExec waits until pid runs the program named comm.
func waitExec(t *testing.T, pid int, comm string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if strings.TrimSpace(string(b)) == comm {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("process %d did not become %s", pid, comm)
		}
	}
}
