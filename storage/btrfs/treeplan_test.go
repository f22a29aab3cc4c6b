package btrfs

import (
	"context"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/google/go-cmp/cmp"
)

// TestTreePlanRandom plays random histories on a volume: random changes, read-only
// snapshots, and reverts to random earlier snapshots, by Revert, by a plan from a
// snapshot of the unchanged volume (as a rollback right after a checkpoint), and by a
// plan from an older snapshot to a newer one, applied to a copy of the older. Every revert must give the target's tree
// exactly (checkReverted), keep the inodes it shares with the target, and be computed
// by a tree plan; the volume accumulates what every revert touched, which is what tree
// plans exist for.
func TestTreePlanRandom(t *testing.T) {
	requireRoot(t)
	p := openTest(t, testConfig(t, 2<<30))
	seeds := []uint64{1, 2, 3, 4, 5, 6}
	if testing.Short() {
		seeds = seeds[:2]
	}
	for _, seed := range seeds {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			playHistory(t, p, seed, 40)
		})
	}
}

func playHistory(t *testing.T, p *Pool, seed uint64, steps int) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 42))
	prefix := fmt.Sprintf("h%d", seed)
	live := prefix + "/live"
	must(t, p.Create(ctx, live))
	l := p.Path(live)
	base(t, l)
	var snaps []string
	head := "" // a snapshot that live still equals, the last taken
	var reverts, planned, forward int
	for step := range steps {
		if rng.IntN(3) > 0 || len(snaps) == 0 {
			for range 1 + rng.IntN(6) {
				mutateRandom(t, rng, l)
			}
			head = ""
		}
		if rng.IntN(2) == 0 || len(snaps) < 2 {
			s := fmt.Sprintf("%s/s%d", prefix, step)
			must(t, p.Snapshot(ctx, live, s, true))
			snaps = append(snaps, s)
			head = s
			continue
		}
		if rng.IntN(5) == 0 {
			// A plan from an older snapshot to a newer one (the newer side is then the
			// target), applied to a writable snapshot of the older: a volume with the
			// base's inodes, as RevertPlanned requires.
			i := rng.IntN(len(snaps) - 1)
			older, newer := snaps[i], snaps[i+1+rng.IntN(len(snaps)-1-i)]
			w := fmt.Sprintf("%s/w%d", prefix, step)
			must(t, p.Snapshot(ctx, older, w, false))
			before := inodes(t, p.Path(w))
			desc := planAndApply(t, p, step, w, older, newer, "planned forward")
			checkRevertedAfter(t, p, w, newer, before, desc)
			must(t, p.Delete(ctx, w))
			forward++
			if t.Failed() {
				t.FailNow()
			}
			continue
		}
		target := snaps[rng.IntN(len(snaps))]
		before := inodes(t, l)
		var desc string
		if head != "" && head != target && rng.IntN(2) == 0 {
			desc = planAndApply(t, p, step, live, head, target, "planned")
			planned++
		} else {
			st, err := p.Revert(ctx, live, target)
			if err != nil {
				t.Fatalf("step %d: Revert(%s): %v", step, target, err)
			}
			desc = fmt.Sprintf("revert to %s: %+v", target, st)
			checkTreeDiff(t, st.Diff, st.DiffNote, desc)
		}
		reverts++
		checkRevertedAfter(t, p, live, target, before, desc)
		if t.Failed() {
			t.FailNow()
		}
		head = ""
	}
	t.Logf("%d snapshots, %d reverts of the volume (%d of them planned from a snapshot of it), %d plans from an older snapshot to a newer", len(snaps), reverts, planned, forward)
}

// planAndApply plans the revert from base to target and applies it to vol, checks
// that it was a tree plan, and returns its description (what, and its stats).
func planAndApply(t *testing.T, p *Pool, step int, vol, base, target, what string) string {
	t.Helper()
	ctx := context.Background()
	pl, err := p.PlanRevert(ctx, base, target)
	if err != nil {
		t.Fatalf("step %d: PlanRevert(%s, %s): %v", step, base, target, err)
	}
	st, err := p.RevertPlanned(ctx, vol, pl)
	if err != nil {
		t.Fatalf("step %d: RevertPlanned(%s -> %s): %v", step, base, target, err)
	}
	desc := fmt.Sprintf("%s %s -> %s: %+v", what, base, target, st)
	checkTreeDiff(t, st.Diff, st.DiffNote, desc)
	return desc
}

func checkTreeDiff(tb testing.TB, how, note, desc string) {
	tb.Helper()
	if how != "tree" {
		tb.Errorf("%s: the difference was computed by %q (%s); want a tree plan", desc, how, note)
	}
}

// checkRevertedAfter is checkReverted with a description of what was done.
func checkRevertedAfter(tb testing.TB, p *Pool, live, snap string, before map[uint64]string, desc string) {
	tb.Helper()
	want := scan(tb, p.Path(snap))
	if diff := cmp.Diff(want, scan(tb, p.Path(live))); diff != "" {
		tb.Errorf("%s: live differs from %s (-snapshot +live):\n%s", desc, snap, diff)
		return
	}
	checkReverted(tb, p, live, snap, before)
}

// mutateRandom makes one random change below l.
func mutateRandom(tb testing.TB, rng *rand.Rand, l string) {
	tb.Helper()
	var files, dirs, all []string
	filepath.WalkDir(l, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == l {
			return err
		}
		all = append(all, p)
		switch {
		case d.Type().IsRegular():
			files = append(files, p)
		case d.IsDir():
			dirs = append(dirs, p)
		}
		return nil
	})
	dirsAndRoot := append([]string{l}, dirs...)
	pick := func(s []string) string { return s[rng.IntN(len(s))] }
	newName := func() string {
		return filepath.Join(pick(dirsAndRoot), fmt.Sprintf("n%d", rng.IntN(1000)))
	}
	data := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('a' + rng.IntN(26))
		}
		return b
	}
	exists := func(p string) bool {
		var st unix.Stat_t
		return unix.Lstat(p, &st) == nil
	}
	ok := func(err error) {
		// Some random changes are refused (a name taken, a directory not empty): that
		// is part of the game, not a failure of the test.
		_ = err
	}
	switch k := rng.IntN(22); {
	case k < 4 && len(files) > 0: // write in place
		f := pick(files)
		var st unix.Stat_t
		must(tb, unix.Lstat(f, &st))
		off := int64(0)
		if st.Size > 0 {
			off = rng.Int64N(st.Size + 1)
		}
		writeAt(tb, f, off, data(1+rng.IntN(20000)))
	case k < 5 && len(files) > 0: // append
		fh, err := os.OpenFile(pick(files), os.O_APPEND|os.O_WRONLY, 0)
		must(tb, err)
		_, err = fh.Write(data(1 + rng.IntN(3000)))
		must(tb, err)
		must(tb, fh.Close())
	case k < 6 && len(files) > 0: // truncate
		must(tb, os.Truncate(pick(files), rng.Int64N(200<<10)))
	case k < 8: // new file, small (inline) or not
		p := newName()
		if !exists(p) {
			must(tb, os.WriteFile(p, data([]int{0, 10, 1500, 5000, 70000}[rng.IntN(5)]), 0o644))
		}
	case k < 9 && len(all) > 0: // delete
		ok(os.RemoveAll(pick(all)))
	case k < 10: // new directory
		ok(os.Mkdir(newName(), 0o755))
	case k < 12 && len(all) > 0: // rename (over an existing name sometimes)
		from, to := pick(all), newName()
		if rng.IntN(3) == 0 {
			to = pick(all)
		}
		if !strings.HasPrefix(to+"/", from+"/") {
			ok(os.Rename(from, to))
		}
	case k < 13 && len(all) > 1: // exchange two names
		a, b := pick(all), pick(all)
		if !strings.HasPrefix(a+"/", b+"/") && !strings.HasPrefix(b+"/", a+"/") {
			ok(unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE))
		}
	case k < 14 && len(files) > 0: // hard link
		ok(os.Link(pick(files), newName()))
	case k < 15: // symlink
		ok(os.Symlink(fmt.Sprintf("target-%d", rng.IntN(100)), newName()))
	case k < 16 && len(all) > 0: // chmod, chown
		p := pick(all)
		if rng.IntN(2) == 0 {
			ok(unix.Fchmodat(unix.AT_FDCWD, p, uint32(rng.IntN(0o7777)|0o700), 0))
		} else {
			ok(os.Lchown(p, rng.IntN(3)*1000, rng.IntN(3)*1000))
		}
	case k < 17 && len(all) > 0: // extended attributes (on the root too)
		p := pick(append(dirsAndRoot, files...))
		if rng.IntN(3) == 0 {
			ok(unix.Removexattr(p, "user.a"))
		} else {
			ok(unix.Setxattr(p, []string{"user.a", "user.b"}[rng.IntN(2)], data(rng.IntN(100)), 0))
		}
	case k < 18 && len(all) > 0: // times
		s := rng.Int64N(1 << 30)
		ok(unix.UtimesNanoAt(unix.AT_FDCWD, pick(all), []unix.Timespec{{Sec: s}, {Sec: s + 1, Nsec: 5}}, unix.AT_SYMLINK_NOFOLLOW))
	case k < 19 && len(files) > 0: // punch a hole
		fh, err := os.OpenFile(pick(files), os.O_RDWR, 0)
		must(tb, err)
		ok(unix.Fallocate(int(fh.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, rng.Int64N(64<<10), rng.Int64N(64<<10)+1))
		must(tb, fh.Close())
	case k < 20 && len(files) > 0: // reflinked copy
		p := newName()
		if !exists(p) {
			reflink(tb, pick(files), p)
		}
	case k < 21: // special files
		p := newName()
		switch rng.IntN(3) {
		case 0:
			ok(unix.Mkfifo(p, 0o640))
		case 1:
			ok(unix.Mknod(p, unix.S_IFCHR|0o600, int(unix.Mkdev(uint32(1+rng.IntN(300)), uint32(rng.IntN(1000))))))
		default:
			ok(unix.Mknod(p, unix.S_IFSOCK|0o600, 0))
		}
	default: // a directory moved into another
		if len(dirs) > 1 {
			a, b := pick(dirs), pick(dirsAndRoot)
			if !strings.HasPrefix(b+"/", a+"/") {
				ok(os.Rename(a, filepath.Join(b, fmt.Sprintf("m%d", rng.IntN(1000)))))
			}
		}
	}
}

// TestTreeLineage: which pairs of volumes allow a tree plan, and from which transaction.
func TestTreeLineage(t *testing.T) {
	ro := func(uuid, parent byte, otransid, ctransid uint64) *subvolInfoArgs {
		v := &subvolInfoArgs{flags: rootSubvolRdonly, otransid: otransid, ctransid: ctransid}
		v.uuid[0], v.parentUUID[0] = uuid, parent
		return v
	}
	rw := func(uuid, parent byte, otransid uint64) *subvolInfoArgs {
		v := ro(uuid, parent, otransid, 0)
		v.flags = 0
		return v
	}
	for _, tc := range []struct {
		name            string
		base, snap, liv *subvolInfoArgs
		g               uint64
		baseNewer, ok   bool
	}{
		{"snapshots of one volume, base newer", ro(2, 1, 20, 19), ro(3, 1, 10, 9), nil, 10, true, true},
		{"snapshots of one volume, snap newer", ro(2, 1, 10, 9), ro(3, 1, 20, 19), nil, 10, false, true},
		{"snapshots of different volumes", ro(2, 1, 20, 19), ro(3, 4, 10, 9), nil, 0, false, false},
		{"no parent", ro(2, 0, 20, 19), ro(3, 0, 10, 9), nil, 0, false, false},
		{"base writable", rw(2, 1, 20), ro(3, 1, 10, 9), nil, 0, false, false},
		{"snap changed after it was taken", ro(2, 1, 20, 19), ro(3, 1, 10, 15), nil, 0, false, false},
		{"live made from snap", ro(2, 5, 30, 29), ro(3, 1, 10, 9), rw(5, 3, 12), 12, true, true},
		{"live made from another", ro(2, 5, 30, 29), ro(3, 1, 10, 9), rw(5, 4, 12), 0, false, false},
	} {
		g, newer, ok := treeLineage(tc.base, tc.snap, tc.liv)
		if g != tc.g || newer != tc.baseNewer || ok != tc.ok {
			t.Errorf("%s: treeLineage = %d, %v, %v; want %d, %v, %v", tc.name, g, newer, ok, tc.g, tc.baseNewer, tc.ok)
		}
	}
}

// TestDataDiff compares extent lists as a tree plan reads them.
func TestDataDiff(t *testing.T) {
	reg := func(off, n, bytenr, extOff uint64) fileExtent {
		return fileExtent{off: off, typ: extentRegular, bytenr: bytenr, diskLen: 1 << 20, extOff: extOff, length: n}
	}
	file := func(size uint64, es ...fileExtent) *inodeState {
		return &inodeState{item: inodeItem{size: size}, extents: es}
	}
	for _, tc := range []struct {
		name string
		h, t *inodeState
		want [][2]uint64
	}{
		{"same extent", file(8192, reg(0, 8192, 1000, 0)), file(8192, reg(0, 8192, 1000, 0)), nil},
		{"one block rewritten", file(12288, reg(0, 4096, 1000, 0), reg(4096, 4096, 2000, 0), reg(8192, 4096, 1000, 8192)),
			file(12288, reg(0, 12288, 1000, 0)), [][2]uint64{{4096, 8192}}},
		{"same extent, other offset", file(4096, reg(0, 4096, 1000, 4096)), file(4096, reg(0, 4096, 1000, 0)), [][2]uint64{{0, 4096}}},
		{"holes on both sides", file(1<<20, reg(0, 4096, 1000, 0)), file(1<<20, reg(0, 4096, 1000, 0)), nil},
		{"hole filled", file(1<<20, reg(0, 4096, 1000, 0), reg(65536, 4096, 3000, 0)), file(1<<20, reg(0, 4096, 1000, 0)),
			[][2]uint64{{65536, 69632}}},
		{"explicit hole is a hole", file(8192, reg(0, 4096, 1000, 0), reg(4096, 4096, 0, 0)), file(8192, reg(0, 4096, 1000, 0)), nil},
		{"shorter on h: the rest differs", file(5000, reg(0, 8192, 1000, 0)), file(8192, reg(0, 8192, 1000, 0)), [][2]uint64{{5000, 8192}}},
		{"longer on h: only t's size counts", file(1<<20, reg(0, 1<<20, 1000, 0)), file(4096, reg(0, 4096, 1000, 0)), nil},
		{"inline equal", file(10, fileExtent{typ: extentInline, ramBytes: 10, inline: "0123456789"}),
			file(10, fileExtent{typ: extentInline, ramBytes: 10, inline: "0123456789"}), nil},
		{"inline changed", file(10, fileExtent{typ: extentInline, ramBytes: 10, inline: "0123456789"}),
			file(10, fileExtent{typ: extentInline, ramBytes: 10, inline: "0123456788"}), [][2]uint64{{0, 10}}},
		{"prealloc against hole", file(8192, fileExtent{off: 0, typ: extentPrealloc, bytenr: 5, diskLen: 8192, length: 8192}), file(8192),
			[][2]uint64{{0, 8192}}},
	} {
		if got := dataDiff(tc.h, tc.t); !slices.Equal(got, tc.want) {
			t.Errorf("%s: dataDiff = %v; want %v", tc.name, got, tc.want)
		}
	}
}

// BenchmarkRevertHistory is W1's filesystem half (REFERENCE.md): a repository of 1,000
// small files and a database file; a step edits three files, adds one, rewrites pages
// of the database and is snapshotted; every other step the volume is reverted to one of
// the last 20 snapshots, planned from the step's own snapshot (a rollback right after a
// checkpoint). The reverts accumulate what they restored, which send pays for and a
// tree plan reads. One op is a step and its snapshot, or a step, its snapshot and a
// revert. Run both ways at once to compare:
//
//	go test ./storage/btrfs -run '^$' -bench RevertHistory -benchtime 200x
func BenchmarkRevertHistory(b *testing.B) {
	requireRoot(b)
	for _, how := range diffWays {
		b.Run(how, func(b *testing.B) {
			p := openTest(b, testConfig(b, 4<<30))
			useDiff(b, p, how)
			ctx := context.Background()
			l := w1Tree(b, p, "w1/live", 2<<20)
			rng := rand.New(rand.NewPCG(7, 7))
			var snaps []string
			var reverts int
			var planMS, applyMS float64
			step := 0
			for b.Loop() {
				for k := range 3 {
					writeAt(b, fmt.Sprintf("%s/src/pkg%02d/file%04d.py", l, 0, rng.IntN(20)*50), int64(10*k), []byte(fmt.Sprint("edited ", step)))
				}
				writeFile(b, fmt.Sprintf("%s/src/new/%d.py", l, step), "new")
				for k := range 10 {
					writeAt(b, l+"/state.db", int64(rng.IntN(500))*4096, fill(4096, byte('a'+k)))
				}
				head := fmt.Sprintf("w1/s%d", step)
				must(b, p.Snapshot(ctx, "w1/live", head, true))
				snaps = append(snaps, head)
				if step%2 == 1 {
					target := snaps[max(0, len(snaps)-20)+rng.IntN(min(20, len(snaps)))]
					if target != head {
						pl, err := p.PlanRevert(ctx, head, target)
						must(b, err)
						st, err := p.RevertPlanned(ctx, "w1/live", pl)
						must(b, err)
						reverts++
						planMS += st.SendMS
						applyMS += st.ApplyMS
					}
				}
				step++
			}
			if reverts > 0 {
				b.ReportMetric(planMS/float64(reverts), "diff-ms/revert")
				b.ReportMetric(applyMS/float64(reverts), "apply-ms/revert")
			}
		})
	}
}

// TestLineageCandidates checks the candidates a lineage keeps across plans (lineage.go)
// against a full search each time: the same inodes with the same transactions, but
// for deleted ones, which the newer snapshot must then not have.
func TestLineageCandidates(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(9, 9))
	must(t, p.Create(ctx, "l/live"))
	l := p.Path("l/live")
	base(t, l)
	var snaps []string
	var lin lineage
	open := func(name string) (int, *subvolInfoArgs) {
		fd, err := unix.Open(p.Path(name), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		must(t, err)
		t.Cleanup(func() { unix.Close(fd) })
		info, err := subvolInfo(fd)
		must(t, err)
		return fd, info
	}
	incremental := 0
	for step := range 40 {
		for range 1 + rng.IntN(4) {
			mutateRandom(t, rng, l)
		}
		s := fmt.Sprintf("l/s%d", step)
		must(t, p.Snapshot(ctx, "l/live", s, true))
		snaps = append(snaps, s)
		if step%5 == 4 && rng.IntN(2) == 0 {
			// Sometimes a revert, whose changes the next search must find too.
			_, err := p.Revert(ctx, "l/live", snaps[rng.IntN(len(snaps))])
			must(t, err)
		}
		newerFd, newer := open(s)
		_, older := open(snaps[rng.IntN(len(snaps))])
		g := older.otransid
		if lin.changed != nil && lin.from <= g {
			incremental++
		}
		got, err := lin.candidates(newSearcher(newerFd), g, newer.otransid)
		must(t, err)
		var fresh lineage
		want, err := fresh.candidates(newSearcher(newerFd), g, newer.otransid)
		must(t, err)
		ns := newSearcher(newerFd)
		for x, tr := range want {
			if got[x] != tr {
				t.Errorf("step %d: inode %d: kept transaction %d, a full search finds %d", step, x, got[x], tr)
			}
		}
		for x := range got {
			if _, ok := want[x]; ok {
				continue
			}
			st, err := ns.loadInode(x)
			must(t, err)
			if st != nil {
				t.Errorf("step %d: inode %d is kept as changed after %d, but the snapshot has it unchanged since", step, x, g)
			}
			lin.gone(x)
		}
	}
	if incremental == 0 {
		t.Fatal("no search was incremental: the test tested nothing of what is kept")
	}
	t.Logf("%d of 40 searches incremental", incremental)
}
