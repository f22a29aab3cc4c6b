package btrfs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/storage"
)

// entry is everything Revert promises to restore about one name of a tree.
type entry struct {
	Type   string // "file", "dir", "symlink", "fifo", "sock", "chr", "blk"
	Perm   uint32 // permission, set-ID and sticky bits
	UID    uint32
	GID    uint32
	Size   int64
	SHA256 string   // content, for files
	Data   []string // data segments "start-end" (holes between them), for files
	Target string   // for symlinks
	Rdev   uint64
	Xattrs map[string]string
	Atime  int64 // ns since the epoch
	Mtime  int64
	Nlink  uint64
	// Link is the first (sorted) path of the tree with the same inode: the hard-link
	// structure, independent of inode numbers.
	Link string
}

// scan reads the tree below dir, keyed by slash path relative to dir ("." for dir).
func scan(tb testing.TB, dir string) map[string]entry {
	tb.Helper()
	m := map[string]entry{}
	first := map[uint64]string{}
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		paths = append(paths, filepath.ToSlash(rel))
		return nil
	})
	must(tb, err)
	sort.Strings(paths)
	for _, rel := range paths {
		p := filepath.Join(dir, rel)
		var st unix.Stat_t
		must(tb, unix.Lstat(p, &st))
		if _, ok := first[st.Ino]; !ok {
			first[st.Ino] = rel
		}
		e := entry{
			Perm: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid, Size: st.Size, Nlink: uint64(st.Nlink),
			Atime: st.Atim.Nano(), Mtime: st.Mtim.Nano(), Link: first[st.Ino], Xattrs: xattrs(tb, p),
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			e.Type = "file"
			e.SHA256, e.Data = fileData(tb, p)
		case unix.S_IFDIR:
			e.Type = "dir"
		case unix.S_IFLNK:
			e.Type = "symlink"
			e.Target, err = os.Readlink(p)
			must(tb, err)
		case unix.S_IFIFO:
			e.Type = "fifo"
		case unix.S_IFSOCK:
			e.Type = "sock"
		case unix.S_IFCHR:
			e.Type, e.Rdev = "chr", st.Rdev
		case unix.S_IFBLK:
			e.Type, e.Rdev = "blk", st.Rdev
		}
		m[rel] = e
	}
	return m
}

func xattrs(tb testing.TB, p string) map[string]string {
	tb.Helper()
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	must(tb, err)
	if n == 0 {
		return nil
	}
	m := map[string]string{}
	for _, name := range strings.Split(strings.TrimSuffix(string(buf[:n]), "\x00"), "\x00") {
		v := make([]byte, 64<<10)
		vn, err := unix.Lgetxattr(p, name, v)
		must(tb, err)
		m[name] = string(v[:vn])
	}
	return m
}

// fileData returns the hash of a file's content and its data/hole layout.
func fileData(tb testing.TB, p string) (string, []string) {
	tb.Helper()
	f, err := os.Open(p)
	must(tb, err)
	defer f.Close()
	h := sha256.New()
	_, err = io.Copy(h, f)
	must(tb, err)
	var segs []string
	fd := int(f.Fd())
	for off := int64(0); ; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break
		}
		must(tb, err)
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		must(tb, err)
		segs = append(segs, fmt.Sprintf("%d-%d", start, end))
		off = end
	}
	return hex.EncodeToString(h.Sum(nil)), segs
}

// inodes maps every inode number of the tree below dir to one of its paths.
func inodes(tb testing.TB, dir string) map[uint64]string {
	tb.Helper()
	m := map[uint64]string{}
	for rel := range scan(tb, dir) {
		var st unix.Stat_t
		must(tb, unix.Lstat(filepath.Join(dir, rel), &st))
		m[st.Ino] = rel
	}
	return m
}

// checkReverted fails unless live equals snap entry for entry, and every inode of snap
// that live had before Revert (before) is still there under snap's name.
func checkReverted(tb testing.TB, p *Pool, live, snap string, before map[uint64]string) {
	tb.Helper()
	want := scan(tb, p.Path(snap))
	if diff := cmp.Diff(want, scan(tb, p.Path(live))); diff != "" {
		tb.Errorf("%s after Revert differs from %s (-snapshot +live):\n%s", live, snap, diff)
	}
	for ino, rel := range inodes(tb, p.Path(snap)) {
		if _, ok := before[ino]; !ok {
			continue // absent from live before: recreated, with a new inode
		}
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(p.Path(live), rel), &st); err == nil && st.Ino != ino {
			tb.Errorf("%s: inode %d after Revert, want %d (live had it before, as %q)", rel, st.Ino, ino, before[ino])
		}
	}
}

// checkWritable fails unless live accepts a new file.
func checkWritable(tb testing.TB, p *Pool, live string) {
	tb.Helper()
	probe := filepath.Join(p.Path(live), "writable-probe")
	if err := os.WriteFile(probe, []byte("x"), 0o644); err != nil {
		tb.Errorf("%s is not writable after Revert: %v", live, err)
		return
	}
	must(tb, os.Remove(probe))
}

func writeAt(tb testing.TB, path string, off int64, data []byte) {
	tb.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	must(tb, err)
	defer f.Close()
	_, err = f.WriteAt(data, off)
	must(tb, err)
}

// reflink makes dst a copy of src that shares its extents.
func reflink(tb testing.TB, src, dst string) {
	tb.Helper()
	in, err := os.Open(src)
	must(tb, err)
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	must(tb, err)
	defer out.Close()
	must(tb, unix.IoctlFileClone(int(out.Fd()), int(in.Fd())))
}

// hasDelalloc reports whether part of the file's data is still only in memory.
func hasDelalloc(tb testing.TB, path string) bool {
	tb.Helper()
	f, err := os.Open(path)
	must(tb, err)
	defer f.Close()
	es, err := fileExtents(int(f.Fd()), 0, 1<<62, false, make([]uint64, 1024))
	must(tb, err)
	for _, e := range es {
		if e.flags&0x4 != 0 { // FIEMAP_EXTENT_DELALLOC
			return true
		}
	}
	return false
}

func fill(n int, b byte) []byte { return []byte(strings.Repeat(string(b), n)) }

// base is the tree every table case starts from.
func base(tb testing.TB, dir string) {
	writeFile(tb, dir+"/etc/hostname", "sandbox\n")
	writeFile(tb, dir+"/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n")
	writeFile(tb, dir+"/home/u/notes.txt", strings.Repeat("notes ", 1000))
	writeFile(tb, dir+"/home/u/deep/a/b/c.txt", "c")
	writeFile(tb, dir+"/bin/tool", "#!/bin/sh\necho tool\n")
	must(tb, os.Chmod(dir+"/bin/tool", 0o755))
	must(tb, os.Symlink("../etc/hostname", dir+"/bin/link"))
	must(tb, os.WriteFile(dir+"/data.bin", fill(40<<10, 'd'), 0o600))
	must(tb, unix.Setxattr(dir+"/etc/passwd", "user.kept", []byte("v1"), 0))
	must(tb, unix.Setxattr(dir+"/etc/hostname", "user.gone", []byte("bye"), 0))
	must(tb, os.Link(dir+"/etc/passwd", dir+"/etc/passwd.link"))
	must(tb, unix.Mkfifo(dir+"/home/u/pipe", 0o620))
	must(tb, os.Chown(dir+"/home/u", 1000, 1000))
	// A 3 MiB file written at once: one extent, as the stream sees it.
	must(tb, os.WriteFile(dir+"/big.db", fill(3<<20, 'b'), 0o644))
	// A sparse file: data, a 1 MiB hole, data.
	writeFile(tb, dir+"/sparse", "head")
	writeAt(tb, dir+"/sparse", 1<<20, []byte("tail"))
}

type revertCase struct {
	name   string
	setup  func(tb testing.TB, dir string) // before the snapshot, after base
	mutate func(tb testing.TB, dir string) // after the snapshot
	check  func(tb testing.TB, st storage.RevertStats)
}

var revertCases = []revertCase{
	{name: "empty diff", mutate: func(testing.TB, string) {},
		check: func(tb testing.TB, st storage.RevertStats) {
			if st.Ops != 0 || st.ClonedBytes != 0 || st.CopiedBytes != 0 {
				tb.Errorf("stats %+v; want no operation for an unchanged volume", st)
			}
		}},
	{name: "edit in place", mutate: func(tb testing.TB, d string) {
		writeAt(tb, d+"/home/u/notes.txt", 100, []byte("EDITED"))
		writeAt(tb, d+"/data.bin", 8192, fill(4096, 'x'))
	}},
	{name: "append", mutate: func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/etc/passwd", os.O_APPEND|os.O_WRONLY, 0)
		must(tb, err)
		_, err = f.WriteString("u:x:1000:1000::/home/u:/bin/sh\n")
		must(tb, err)
		must(tb, f.Close())
	}},
	{name: "truncate shorter", mutate: func(tb testing.TB, d string) {
		must(tb, os.Truncate(d+"/data.bin", 5000))
		must(tb, os.Truncate(d+"/big.db", 1<<20+17))
	}},
	{name: "truncate longer", mutate: func(tb testing.TB, d string) {
		must(tb, os.Truncate(d+"/data.bin", 1<<20))
		must(tb, os.Truncate(d+"/etc/hostname", 3))
		must(tb, os.Truncate(d+"/etc/hostname", 9000))
	}},
	{name: "sparse hole filled", mutate: func(tb testing.TB, d string) {
		writeAt(tb, d+"/sparse", 300<<10, fill(8192, 'h'))
	}},
	{name: "sparse hole punched", mutate: func(tb testing.TB, d string) {
		f, err := os.OpenFile(d+"/big.db", os.O_RDWR, 0)
		must(tb, err)
		must(tb, unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 1<<20, 256<<10))
		must(tb, f.Close())
	}},
	{name: "delete file", mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/etc/hostname"))
		must(tb, os.Remove(d+"/bin/tool"))
	}},
	{name: "create file", mutate: func(tb testing.TB, d string) {
		writeFile(tb, d+"/etc/new.conf", "new")
		writeFile(tb, d+"/new/dir/tree/f", "f")
	}},
	{name: "rename file", mutate: func(tb testing.TB, d string) {
		must(tb, os.Rename(d+"/etc/hostname", d+"/etc/hostname.old"))
	}},
	{name: "swap two files", mutate: func(tb testing.TB, d string) {
		must(tb, os.Rename(d+"/etc/hostname", d+"/etc/tmp"))
		must(tb, os.Rename(d+"/etc/passwd", d+"/etc/hostname"))
		must(tb, os.Rename(d+"/etc/tmp", d+"/etc/passwd"))
	}},
	{name: "rename directory", mutate: func(tb testing.TB, d string) {
		must(tb, os.Rename(d+"/home/u", d+"/home/user"))
	}},
	{name: "swap nested directories", mutate: func(tb testing.TB, d string) {
		// a/b/c becomes c/b/a: the kernel has to order moves of directories that
		// are each other's ancestors.
		must(tb, os.Rename(d+"/home/u/deep/a", d+"/home/x"))
		must(tb, os.Rename(d+"/home/x/b", d+"/home/u/deep/b"))
		must(tb, os.Rename(d+"/home/x", d+"/home/u/deep/b/a"))
	}},
	{name: "move across directories", mutate: func(tb testing.TB, d string) {
		must(tb, os.Rename(d+"/home/u/notes.txt", d+"/etc/notes.txt"))
		must(tb, os.Rename(d+"/bin/link", d+"/home/u/deep/link"))
	}},
	{name: "file replaced by directory", mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/etc/hostname"))
		writeFile(tb, d+"/etc/hostname/inside", "x")
	}},
	{name: "directory replaced by file", mutate: func(tb testing.TB, d string) {
		must(tb, os.RemoveAll(d+"/home/u/deep"))
		writeFile(tb, d+"/home/u/deep", "now a file")
	}},
	{name: "hard links added", mutate: func(tb testing.TB, d string) {
		must(tb, os.Link(d+"/data.bin", d+"/home/u/data.link"))
		must(tb, os.Link(d+"/etc/passwd", d+"/passwd.third"))
	}},
	{name: "hard links removed", mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/etc/passwd"))
	}},
	{name: "hard link kept, first name removed", mutate: func(tb testing.TB, d string) {
		must(tb, os.Rename(d+"/etc/passwd.link", d+"/etc/passwd"))
		writeAt(tb, d+"/etc/passwd", 0, []byte("ROOT"))
	}},
	{name: "symlink retargeted", mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/bin/link"))
		must(tb, os.Symlink("/outside/of/the/sandbox", d+"/bin/link"))
	}},
	{name: "chmod and chown", mutate: func(tb testing.TB, d string) {
		must(tb, os.Chmod(d+"/bin/tool", 0o4711))
		must(tb, os.Chown(d+"/etc/passwd", 1000, 1001))
		must(tb, os.Chown(d+"/home/u", 0, 0))
		must(tb, os.Chmod(d+"/home", 0o700))
		must(tb, os.Lchown(d+"/bin/link", 1000, 1000))
		must(tb, os.Chmod(d, 0o711))
	}},
	{name: "setuid kept across owner change", setup: func(tb testing.TB, d string) {
		must(tb, os.Chown(d+"/bin/tool", 1000, 1000))
		must(tb, os.Chmod(d+"/bin/tool", 0o6755))
	}, mutate: func(tb testing.TB, d string) {
		must(tb, os.Chown(d+"/bin/tool", 0, 0)) // clears the set-ID bits
	}},
	{name: "xattrs", mutate: func(tb testing.TB, d string) {
		must(tb, unix.Setxattr(d+"/etc/passwd", "user.kept", []byte("v2, longer"), 0))
		must(tb, unix.Setxattr(d+"/data.bin", "user.new", []byte("n"), 0))
		must(tb, unix.Removexattr(d+"/etc/hostname", "user.gone"))
		must(tb, unix.Setxattr(d, "user.root", []byte("r"), 0))
		must(tb, unix.Setxattr(d+"/home/u", "trusted.dir", []byte("t"), 0))
	}},
	{name: "xattr on the root removed", setup: func(tb testing.TB, d string) {
		must(tb, unix.Setxattr(d, "user.root", []byte("r"), 0))
	}, mutate: func(tb testing.TB, d string) {
		must(tb, unix.Removexattr(d, "user.root"))
	}},
	{name: "special files", mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/home/u/pipe"))
		must(tb, unix.Mkfifo(d+"/etc/fifo", 0o600))
		must(tb, unix.Mknod(d+"/etc/null", unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
		must(tb, unix.Mknod(d+"/etc/sock", unix.S_IFSOCK|0o600, 0))
	}},
	{name: "special files restored", setup: func(tb testing.TB, d string) {
		must(tb, unix.Mknod(d+"/etc/null", unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
		must(tb, unix.Mknod(d+"/etc/loop", unix.S_IFBLK|0o660, int(unix.Mkdev(7, 300))))
		must(tb, unix.Mknod(d+"/etc/sock", unix.S_IFSOCK|0o755, 0))
	}, mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/home/u/pipe"))
		must(tb, os.Remove(d+"/etc/null"))
		must(tb, os.Remove(d+"/etc/loop"))
		must(tb, os.Remove(d+"/etc/sock"))
	}},
	{name: "big file, few blocks changed", mutate: func(tb testing.TB, d string) {
		for _, off := range []int64{1 << 20, 1<<20 + 64<<10, 2 << 20} {
			writeAt(tb, d+"/big.db", off, fill(4096, 'Z'))
		}
	}, check: func(tb testing.TB, st storage.RevertStats) {
		// A tree plan clones blocks less than mergeGap apart as one range.
		if st.ClonedBytes < 3*4096 || st.ClonedBytes > 3*4096+2*mergeGap || st.CopiedBytes != 0 {
			tb.Errorf("cloned %d and copied %d bytes; want the 3 changed blocks (%d bytes, and at most the %d bytes between two of them) cloned, not the 3 MiB file", st.ClonedBytes, st.CopiedBytes, 3*4096, 64<<10)
		}
	}},
	{name: "reflinked copy deleted", setup: func(tb testing.TB, d string) {
		reflink(tb, d+"/big.db", d+"/big.copy")
		reflink(tb, d+"/data.bin", d+"/home/u/data.copy")
	}, mutate: func(tb testing.TB, d string) {
		must(tb, os.Remove(d+"/big.copy"))
		must(tb, os.Remove(d+"/home/u/data.copy"))
		writeAt(tb, d+"/big.db", 4096, fill(4096, 'r'))
	}},
	{name: "reflinked copy made", mutate: func(tb testing.TB, d string) {
		reflink(tb, d+"/big.db", d+"/big.copy")
		must(tb, os.Remove(d+"/data.bin"))
		reflink(tb, d+"/big.db", d+"/data.bin")
	}},
	{name: "big file rewritten", mutate: func(tb testing.TB, d string) {
		must(tb, os.WriteFile(d+"/big.db", fill(3<<20, 'n'), 0o644))
	}},
	{name: "unflushed writes", mutate: func(tb testing.TB, d string) {
		// Buffered writes, no fsync: the data is in the page cache only when Revert
		// starts, and the committed tree still has the old extents.
		f, err := os.OpenFile(d+"/big.db", os.O_WRONLY, 0)
		must(tb, err)
		_, err = f.WriteAt(fill(512<<10, 'u'), 256<<10)
		must(tb, err)
		must(tb, f.Close())
		writeFile(tb, d+"/unflushed-new", "new")
		must(tb, os.WriteFile(d+"/data.bin", fill(100<<10, 'u'), 0o600))
		writeAt(tb, d+"/sparse", 512<<10, fill(64<<10, 'u'))
		// Only data written into a hole shows as delalloc (see fileExtents); the rest
		// was written at the same time.
		if !hasDelalloc(tb, d+"/sparse") {
			tb.Fatal("the writes were flushed before Revert, so this case would test nothing")
		}
	}},
	{name: "delete subtree", mutate: func(tb testing.TB, d string) {
		must(tb, os.RemoveAll(d+"/home"))
	}},
	{name: "times only", mutate: func(tb testing.TB, d string) {
		ts := []unix.Timespec{{Sec: 1, Nsec: 2}, {Sec: 3, Nsec: 4}}
		must(tb, unix.UtimesNano(d+"/etc/passwd", ts))
		must(tb, unix.UtimesNanoAt(unix.AT_FDCWD, d+"/bin/link", ts, unix.AT_SYMLINK_NOFOLLOW))
		must(tb, unix.UtimesNano(d+"/home", ts))
	}},
	{name: "many new files", mutate: func(tb testing.TB, d string) {
		for i := range 300 {
			writeFile(tb, fmt.Sprintf("%s/many/%d/f%d", d, i%7, i), strings.Repeat("m", i))
		}
	}},
	{name: "everything at once", mutate: mutateMany},
}

// mutateMany makes many kinds of change at once, so that the kernel has to order them.
func mutateMany(tb testing.TB, d string) {
	writeAt(tb, d+"/home/u/notes.txt", 100, []byte("EDITED"))
	must(tb, os.Rename(d+"/etc/hostname", d+"/etc/tmp"))
	must(tb, os.Rename(d+"/etc/passwd", d+"/etc/hostname"))
	must(tb, os.Rename(d+"/etc/tmp", d+"/etc/passwd"))
	must(tb, os.Rename(d+"/home/u", d+"/home/user"))
	must(tb, os.Rename(d+"/home/user/deep/a", d+"/a"))
	must(tb, os.Remove(d+"/bin/tool"))
	writeFile(tb, d+"/bin/tool/x", "dir now")
	must(tb, os.Remove(d+"/bin/link"))
	must(tb, os.Symlink("elsewhere", d+"/bin/link"))
	must(tb, os.Link(d+"/data.bin", d+"/a/data.link"))
	must(tb, os.Truncate(d+"/data.bin", 100))
	writeAt(tb, d+"/big.db", 2<<20, fill(4096, 'Z'))
	writeAt(tb, d+"/sparse", 300<<10, fill(8192, 'h'))
	must(tb, unix.Setxattr(d+"/etc/passwd", "user.kept", []byte("v2"), 0))
	must(tb, os.Chmod(d+"/etc", 0o700))
	must(tb, os.Remove(d+"/home/user/pipe"))
	for i := range 20 {
		writeFile(tb, fmt.Sprintf("%s/new/%d", d, i), "n")
	}
}

// diffWays are the two ways a difference is computed: a tree plan (treeplan.go), and
// the kernel's send, which tree plans fall back to.
var diffWays = []string{"tree", "send"}

// useDiff makes p compute differences the way how, and returns a check that a revert's
// stats say so.
func useDiff(tb testing.TB, p *Pool, how string) func(tb testing.TB, st storage.RevertStats) {
	p.sendOnly = how == "send"
	tb.Cleanup(func() { p.sendOnly = false })
	return func(tb testing.TB, st storage.RevertStats) {
		tb.Helper()
		if st.Diff != how {
			tb.Errorf("the difference was computed by %q (%s); want %q", st.Diff, st.DiffNote, how)
		}
	}
}

func TestRevert(t *testing.T) {
	requireRoot(t)
	p := openTest(t, testConfig(t, 2<<30))
	for _, how := range diffWays {
		t.Run(how, func(t *testing.T) { testRevertCases(t, p, how) })
	}
}

func testRevertCases(t *testing.T, p *Pool, how string) {
	ctx := context.Background()
	checkDiff := useDiff(t, p, how)
	for i, tc := range revertCases {
		t.Run(tc.name, func(t *testing.T) {
			live, snap := fmt.Sprintf("%s%d/live", how, i), fmt.Sprintf("%s%d/snap", how, i)
			must(t, p.Create(ctx, live))
			base(t, p.Path(live))
			if tc.setup != nil {
				tc.setup(t, p.Path(live))
			}
			must(t, p.Snapshot(ctx, live, snap, true))
			tc.mutate(t, p.Path(live))
			before := inodes(t, p.Path(live))

			st, err := p.Revert(ctx, live, snap)
			if err != nil {
				t.Fatalf("Revert: %v", err)
			}
			t.Logf("%+v", st)
			checkDiff(t, st)
			checkReverted(t, p, live, snap, before)
			if tc.check != nil {
				tc.check(t, st)
			}
			// A second Revert finds at most times to set again: it cannot restore the
			// change times, so the kernel still sees the inodes it touched as changed.
			st, err = p.Revert(ctx, live, snap)
			if err != nil {
				t.Fatalf("second Revert: %v", err)
			}
			checkReverted(t, p, live, snap, before)
			checkWritable(t, p, live)
		})
	}
}

// newRevertPair makes a volume with the base tree, a read-only snapshot of it, and
// returns their names.
func newRevertPair(tb testing.TB, p *Pool, prefix string) (live, snap string) {
	tb.Helper()
	ctx := context.Background()
	live, snap = prefix+"/live", prefix+"/snap"
	must(tb, p.Create(ctx, live))
	base(tb, p.Path(live))
	must(tb, p.Snapshot(ctx, live, snap, true))
	return live, snap
}

// TestRevertKeepsOpenFiles is the reason for Revert: descriptors, mappings and
// working directories opened on live before it see the snapshot afterwards.
func TestRevertKeepsOpenFiles(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "open")
	l := p.Path(live)
	want, err := os.ReadFile(l + "/big.db")
	must(t, err)

	f, err := os.OpenFile(l+"/big.db", os.O_RDWR, 0) // held across Revert, as a zygote would
	must(t, err)
	defer f.Close()
	var st0 unix.Stat_t
	must(t, unix.Fstat(int(f.Fd()), &st0))
	shared, err := unix.Mmap(int(f.Fd()), 0, len(want), unix.PROT_READ, unix.MAP_SHARED)
	must(t, err)
	defer unix.Munmap(shared)
	private, err := unix.Mmap(int(f.Fd()), 0, len(want), unix.PROT_READ, unix.MAP_PRIVATE) // a library's text
	must(t, err)
	defer unix.Munmap(private)
	_ = shared[2<<20] + private[2<<20] // fault the pages in before they change
	dir, err := os.Open(l + "/home/u")
	must(t, err)
	defer dir.Close()

	// After the snapshot: rewrite through the held descriptor, rename its directory.
	_, err = f.WriteAt(fill(8192, 'Z'), 2<<20)
	must(t, err)
	must(t, f.Truncate(int64(len(want))+12345))
	must(t, os.Rename(l+"/home/u", l+"/home/moved"))
	writeFile(t, l+"/home/moved/notes.txt", "overwritten in place")

	if _, err := p.Revert(ctx, live, snap); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<40))
	must(t, err)
	if string(got) != string(want) {
		t.Errorf("the descriptor held across Revert reads %d bytes that differ from the snapshot's %d", len(got), len(want))
	}
	if string(shared) != string(want) || string(private) != string(want) {
		t.Errorf("mappings held across Revert do not show the snapshot's content (shared ok: %v, private ok: %v)", string(shared) == string(want), string(private) == string(want))
	}
	var st1 unix.Stat_t
	must(t, unix.Fstat(int(f.Fd()), &st1))
	var onDisk unix.Stat_t
	must(t, unix.Stat(l+"/big.db", &onDisk))
	if st1.Ino != st0.Ino || onDisk.Ino != st0.Ino || st1.Nlink != 1 {
		t.Errorf("inode %d (nlink %d), path now names %d; want the same inode %d, still linked", st1.Ino, st1.Nlink, onDisk.Ino, st0.Ino)
	}
	// The held directory is back at its name, and relative lookups through it work.
	b, err := os.ReadFile(fmt.Sprintf("/proc/self/fd/%d/notes.txt", dir.Fd()))
	must(t, err)
	if string(b) != strings.Repeat("notes ", 1000) {
		t.Errorf("notes.txt through the held directory: %.40q...; want the snapshot's", b)
	}
	var ds unix.Stat_t
	must(t, unix.Stat(l+"/home/u", &ds))
	var held unix.Stat_t
	must(t, unix.Fstat(int(dir.Fd()), &held))
	if ds.Ino != held.Ino {
		t.Errorf("home/u is inode %d, the held directory %d; want the same", ds.Ino, held.Ino)
	}
	checkReverted(t, p, live, snap, map[uint64]string{})
	// The descriptor opened for writing before Revert still writes.
	if _, err := f.WriteAt([]byte("w"), 0); err != nil {
		t.Errorf("write through a descriptor held across Revert: %v", err)
	}
}

// TestRevertDeletedOpenFile: a file unlinked after the snapshot while a process holds it
// open. The kernel sends it as a new file (the held inode has no name to update), so its
// name comes back with a new inode, and the held one stays unlinked.
func TestRevertDeletedOpenFile(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "deleted")
	l := p.Path(live)
	f, err := os.Open(l + "/etc/passwd")
	must(t, err)
	defer f.Close()
	must(t, os.Remove(l+"/etc/passwd"))
	must(t, os.Remove(l+"/etc/passwd.link"))
	if _, err := p.Revert(ctx, live, snap); err != nil {
		t.Fatal(err)
	}
	checkReverted(t, p, live, snap, map[uint64]string{})
	var st unix.Stat_t
	must(t, unix.Fstat(int(f.Fd()), &st))
	t.Logf("held unlinked inode: nlink %d after Revert", st.Nlink)
}

// TestRevertInterrupted stops the apply after every possible number of operations, as
// a crash would, and checks that Revert then converges, keeping the shared inodes.
func TestRevertInterrupted(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "probe")
	mutateMany(t, p.Path(live))
	st, err := p.Revert(ctx, live, snap)
	must(t, err)
	total := st.Ops
	if total < 10 {
		t.Fatalf("the mutation needs only %d operations; want a longer stream", total)
	}
	for n := 1; n < total; n++ {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			live, snap := newRevertPair(t, p, fmt.Sprintf("stop%d", n))
			mutateMany(t, p.Path(live))
			before := inodes(t, p.Path(live))
			_, err := p.revert(ctx, live, snap, revertOptions{stopAfter: n})
			if !errors.Is(err, errStopped) || !strings.Contains(err.Error(), "partly reverted") || !strings.Contains(err.Error(), "run Revert again") {
				t.Fatalf("interrupted Revert: %v; want the injected failure, saying the volume is partly reverted and to run Revert again", err)
			}
			checkWritable(t, p, live)
			if _, err := p.Revert(ctx, live, snap); err != nil {
				t.Fatalf("Revert after the interruption: %v", err)
			}
			checkReverted(t, p, live, snap, before)
		})
	}
}

// TestRevertKeepsLiveWritable: while Revert runs, live stays writable (a process of the
// sandbox, or CRIU dumping one from inside, may create files meanwhile), and Revert
// leaves no snapshot of its own behind; one a crash left is removed by Recover.
func TestRevertKeepsLiveWritable(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "writable")
	l := p.Path(live)
	stop := make(chan struct{})
	werr := make(chan error, 1)
	go func() {
		defer close(werr)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			d := filepath.Join(l, fmt.Sprintf("writer-%d", i))
			if err := os.Mkdir(d, 0o755); err != nil {
				werr <- err
				return
			}
			if err := os.Remove(d); err != nil {
				werr <- err
				return
			}
		}
	}()
	for i := 0; i < 20; i++ {
		mutateMany(t, l)
		if _, err := p.Revert(ctx, live, snap); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	if err := <-werr; err != nil {
		t.Fatalf("a write to live during Revert failed: %v", err)
	}
	leftovers := func() []string {
		ents, err := os.ReadDir(filepath.Dir(l))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".tmp-") {
				out = append(out, e.Name())
			}
		}
		return out
	}
	if got := leftovers(); len(got) > 0 {
		t.Fatalf("Revert left %v next to live", got)
	}
	// What a crash inside Revert leaves: the snapshot under its hidden name.
	must(t, p.Snapshot(ctx, live, filepath.Join(filepath.Dir(live), "kept"), true))
	dirfd, err := unix.Open(filepath.Dir(l), unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(dirfd)
	must(t, unix.Renameat(dirfd, "kept", dirfd, tmpName(filepath.Base(l))))
	must(t, p.Recover(ctx))
	if got := leftovers(); len(got) > 0 {
		t.Fatalf("Recover left %v", got)
	}
	checkWritable(t, p, live)
}

// TestRevertTwice reverts, changes the volume again, and reverts to the same snapshot.
func TestRevertTwice(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "twice")
	l := p.Path(live)
	mutateMany(t, l)
	before := inodes(t, l)
	_, err := p.Revert(ctx, live, snap)
	must(t, err)
	checkReverted(t, p, live, snap, before)

	// Different changes, touching some of what the first Revert rewrote.
	writeAt(t, l+"/big.db", 2<<20, fill(4096, 'Y'))
	writeAt(t, l+"/big.db", 0, fill(100, 'Y'))
	must(t, os.Rename(l+"/etc/passwd", l+"/passwd"))
	must(t, os.RemoveAll(l+"/home"))
	writeFile(t, l+"/a/b/c", "again")
	before = inodes(t, l)
	st, err := p.Revert(ctx, live, snap)
	must(t, err)
	t.Logf("%+v", st)
	checkReverted(t, p, live, snap, before)
	checkWritable(t, p, live)
}

// TestRevertAgainSetsNothing reverts twice in a row: the second difference still names
// every inode the first one changed (their change times differ from the snapshot's for
// good), but finds their attributes already right, so it changes nothing, and leaves
// their change times where they were. A tree plan compares without the change times
// and has nothing to skip; send's difference has the attributes to skip.
func TestRevertAgainSetsNothing(t *testing.T) {
	p := newPool(t)
	for _, how := range diffWays {
		t.Run(how, func(t *testing.T) { testRevertAgainSetsNothing(t, p, how) })
	}
}

func testRevertAgainSetsNothing(t *testing.T, p *Pool, how string) {
	ctx := context.Background()
	useDiff(t, p, how)
	live, snap := newRevertPair(t, p, "again-"+how)
	l := p.Path(live)
	// Changes to files the snapshot has, in place (a recreated file would be recreated
	// again by every Revert: its inode is not the snapshot's).
	writeAt(t, l+"/big.db", 4096, fill(4096, 'Q'))
	must(t, os.Chmod(l+"/etc/passwd", 0o600))
	must(t, os.Chtimes(l+"/home/u/deep/a/b/c.txt", time.Unix(1, 0), time.Unix(2, 0)))
	must(t, os.Chown(l+"/home/u", 4242, 4242))
	st, err := p.Revert(ctx, live, snap)
	must(t, err)
	if st.Ops == 0 {
		t.Fatal("the first Revert applied nothing")
	}
	ctimes := func() map[string]unix.Timespec {
		out := map[string]unix.Timespec{}
		filepath.WalkDir(l, func(path string, d fs.DirEntry, err error) error {
			var s unix.Stat_t
			if err == nil && unix.Lstat(path, &s) == nil {
				out[path] = s.Ctim
			}
			return nil
		})
		return out
	}
	before := ctimes()
	st, err = p.Revert(ctx, live, snap)
	must(t, err)
	if st.Ops != 0 || (how == "send") != (st.Skipped > 0) {
		t.Fatalf("second Revert by %s: %d operations applied, %d skipped; want none applied, and some skipped by send only (the attributes of what the first changed)", how, st.Ops, st.Skipped)
	}
	if diff := cmp.Diff(before, ctimes()); diff != "" {
		t.Fatalf("the second Revert moved change times (-before +after):\n%s", diff)
	}
	checkReverted(t, p, live, snap, inodes(t, l))
}

// TestRevertToRollbackSource reverts a volume that is itself a writable snapshot of the
// read-only one (a rollback's root), the other direction of "one of its snapshots".
func TestRevertToRollbackSource(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	_, snap := newRevertPair(t, p, "src")
	must(t, p.Snapshot(ctx, snap, "rolled/live", false))
	mutateMany(t, p.Path("rolled/live"))
	before := inodes(t, p.Path("rolled/live"))
	st, err := p.Revert(ctx, "rolled/live", snap)
	must(t, err)
	checkTreeDiff(t, st.Diff, st.DiffNote, "revert of a volume made from its target")
	checkReverted(t, p, "rolled/live", snap, before)
}

func TestRevertBadInput(t *testing.T) {
	p := newPool(t)
	ctx := context.Background()
	live, snap := newRevertPair(t, p, "bad")
	must(t, p.Snapshot(ctx, live, "bad/writable", false))
	must(t, p.Snapshot(ctx, live, "bad/frozen", true))
	must(t, os.MkdirAll(p.Path("bad/plain"), 0o755))
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	for _, tc := range []struct {
		name, live, snap string
		ctx              context.Context
		want             error
		says             string
	}{
		{"snapshot not read-only", live, "bad/writable", ctx, errdefs.ErrFailedPrecondition, "read-only snapshot"},
		{"live read-only", "bad/frozen", snap, ctx, errdefs.ErrFailedPrecondition, "SetReadOnly(false)"},
		{"live missing", "bad/missing", snap, ctx, errdefs.ErrNotFound, "no such volume"},
		{"snapshot missing", live, "bad/missing", ctx, errdefs.ErrNotFound, "no such volume"},
		{"live not a volume", "bad/plain", snap, ctx, errdefs.ErrNotFound, "not a volume"},
		{"same name", live, live, ctx, errdefs.ErrInvalidArgument, "to itself"},
		{"bad name", "../x", snap, ctx, errdefs.ErrInvalidArgument, "volume name"},
		{"canceled", live, snap, canceled, context.Canceled, "canceled"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := p.Revert(tc.ctx, tc.live, tc.snap)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("Revert(%q, %q) = %v; want %v saying %q", tc.live, tc.snap, err, tc.want, tc.says)
			}
		})
	}
	// Nothing was changed by the refusals, and live is still writable.
	checkReverted(t, p, live, snap, map[uint64]string{})
	checkWritable(t, p, live)
	var pool storage.Pool = p
	if _, ok := pool.(storage.Reverter); !ok {
		t.Error("*btrfs.Pool does not implement storage.Reverter")
	}
}

func TestSendStreamChecksum(t *testing.T) {
	cmd := func(c uint16, attrs ...[]byte) []byte {
		var body []byte
		for i, a := range attrs {
			body = append(body, byte(sendAttrPath+i), 0, byte(len(a)), 0)
			body = append(body, a...)
		}
		b := make([]byte, sendCmdHeaderLen, sendCmdHeaderLen+len(body))
		b[0], b[4] = byte(len(body)), byte(c)
		b = append(b, body...)
		crc := crc32cRaw(b)
		b[6], b[7], b[8], b[9] = byte(crc), byte(crc>>8), byte(crc>>16), byte(crc>>24)
		return b
	}
	header := append([]byte(sendStreamMagic), 1, 0, 0, 0)
	good := append(append(append([]byte{}, header...), cmd(sendCmdUnlink, []byte("a/b"))...), cmd(sendCmdEnd)...)
	var got []string
	err := readSendStream(strings.NewReader(string(good)), func(c *sendCommand) error {
		got = append(got, c.String())
		return nil
	})
	must(t, err)
	if diff := cmp.Diff([]string{`unlink "a/b"`, "end"}, got); diff != "" {
		t.Errorf("decoded commands (-want +got):\n%s", diff)
	}
	for name, stream := range map[string][]byte{
		"flipped bit":   append(append([]byte{}, good[:len(header)+11]...), append([]byte{good[len(header)+11] ^ 1}, good[len(header)+12:]...)...),
		"no end":        good[:len(good)-sendCmdHeaderLen],
		"bad magic":     append([]byte("btrfs-strean\x00"), good[len(sendStreamMagic):]...),
		"version 2":     append(append([]byte(sendStreamMagic), 2, 0, 0, 0), good[len(header):]...),
		"trailing data": append(append([]byte{}, good...), 0),
	} {
		if err := readSendStream(strings.NewReader(string(stream)), func(*sendCommand) error { return nil }); !errors.Is(err, errSendStream) {
			t.Errorf("%s: %v; want errSendStream", name, err)
		}
	}
}

// BenchmarkRevert measures the rollback step of a W1-like sandbox: a volume of 1000
// small files and a 600 KB database-like file; each op edits 3 small files, creates one,
// deletes one, rewrites 10 pages of the big file, then reverts to the snapshot. The
// changes take microseconds; the op is the Revert. The figures are also broken down
// (the ms metrics are the averages of RevertStats).
//
// Every op changes the same files, so that ops are alike: a file that Revert brought
// back after a deletion has a new inode, which the kernel keeps seeing as different from
// the snapshot's, so every later Revert to that snapshot recreates it again (and sets
// again the times of every inode a Revert touched, whose change time it cannot restore).
// Deleting a different file at each op makes the op grow with b.N.
//
// Measured on the development VM (2 vCPU AMD EPYC, Linux 6.18, 4 GiB sparse image on
// ext4 through a loop device), -benchtime 3s, three runs: 5.3-6.2 ms/op, of which ~2 ms
// the two read-only flips (a transaction commit each), ~2.6-3.1 ms the send (with the
// kernel's flush of the step's dirty data and its commit), ~0.6 ms the apply of 18
// operations; 41680 bytes cloned (the 10 pages and the small files), none copied.
// w1Tree makes the volume name with W1's files as the revert benchmarks see them: a
// repository of 1,000 small files and a database file of dbBytes; it returns its path.
func w1Tree(tb testing.TB, p *Pool, name string, dbBytes int) string {
	must(tb, p.Create(context.Background(), name))
	l := p.Path(name)
	for i := range 1000 {
		writeFile(tb, fmt.Sprintf("%s/src/pkg%02d/file%04d.py", l, i%50, i), strings.Repeat(fmt.Sprintf("line %d\n", i), 20))
	}
	must(tb, os.WriteFile(l+"/state.db", fill(dbBytes, 's'), 0o644))
	return l
}

func BenchmarkRevert(b *testing.B) {
	requireRoot(b)
	p := openTest(b, testConfig(b, 4<<30))
	ctx := context.Background()
	l := w1Tree(b, p, "w1/live", 600<<10)
	must(b, p.Snapshot(ctx, "w1/live", "w1/snap", true))
	small := func(i int) string { return fmt.Sprintf("%s/src/pkg%02d/file%04d.py", l, i%50, i) }
	var sum storage.RevertStats
	i := 0
	for b.Loop() {
		for k := range 3 {
			writeAt(b, small(100+k), 10, []byte(fmt.Sprint("edited ", i)))
		}
		writeFile(b, fmt.Sprintf("%s/src/new%d.py", l, i), "new")
		must(b, os.Remove(small(500)))
		for k := range 10 {
			writeAt(b, l+"/state.db", int64((i*13+k*11)%150)*4096, fill(4096, byte('a'+k)))
		}
		st, err := p.Revert(ctx, "w1/live", "w1/snap")
		must(b, err)
		sum.Ops += st.Ops
		sum.ClonedBytes += st.ClonedBytes
		sum.CopiedBytes += st.CopiedBytes
		sum.SnapshotMS += st.SnapshotMS
		sum.SendMS += st.SendMS
		sum.ApplyMS += st.ApplyMS
		i++
	}
	n := float64(i)
	b.ReportMetric(float64(sum.Ops)/n, "fsops/op")
	b.ReportMetric(float64(sum.ClonedBytes)/n, "cloned-B/op")
	b.ReportMetric(float64(sum.CopiedBytes)/n, "copied-B/op")
	b.ReportMetric(sum.SnapshotMS/n, "snapshot-ms/op")
	b.ReportMetric(sum.SendMS/n, "send-ms/op")
	b.ReportMetric(sum.ApplyMS/n, "apply-ms/op")
}
