package fixup

import (
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	criu_core "github.com/checkpoint-restore/go-criu/v8/crit/images/criu-core"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/regfile"
	remap_file_path "github.com/checkpoint-restore/go-criu/v8/crit/images/remap-file-path"
	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// TestApply is the zygote's life: a process forks its zygote at a checkpoint (the test
// records the process's Spec from /proc then), goes on changing what it shares with the
// zygote, the zygote is dumped alone by CRIU, both die, the filesystem goes back to the
// checkpoint's (as the checkpoint's snapshot would), Apply rewrites the dump, and CRIU
// restores it. The restored process must be the recorded one: same PID, session and
// group, descriptors, offsets, flags, locks, pipe contents, cwd, executable, mappings,
// parent-death signal, running.
func TestApply(t *testing.T) {
	criuPath := require(t)
	tests := []struct {
		name string
		// mutate is what the process does after the checkpoint (the holder's mutate).
		mutate string
		// revert puts the filesystem back as it was at the checkpoint.
		revert func(t *testing.T, dir string)
		// dumped checks that the dump saw what the mutation did (the data file's entry).
		dumped func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string)
		// linkRemap dumps with --link-remap; edit changes the recorded Spec.
		linkRemap bool
		edit      func(s *Spec, dir string)
		// sibling restores with --restore-sibling: the restored process is a child of
		// criu's parent (the test), not of criu.
		sibling bool
	}{
		{
			name: "unchanged", mutate: "unchanged",
			dumped: func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string) {
				if data.GetPos() != 10 || data.GetSize() != uint64(len(dataContent)) {
					t.Errorf("dumped data file at %d of %d bytes, want 10 of %d", data.GetPos(), data.GetSize(), len(dataContent))
				}
			},
		},
		{
			// Offsets and status flags move, pipes are drained and refilled, locks change, the
			// file grows and changes mode (CRIU would refuse the file by size and mode).
			name: "moved", mutate: "moved",
			revert: func(t *testing.T, dir string) {
				write(t, filepath.Join(dir, "data"), dataContent)
				if err := os.Chmod(filepath.Join(dir, "data"), 0o644); err != nil {
					t.Fatal(err)
				}
			},
			dumped: func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string) {
				if data.GetPos() != 30 || data.GetFlags()&(unix.O_APPEND|unix.O_NONBLOCK) == 0 || data.GetMode()&0o777 != 0o600 {
					t.Errorf("dumped data file at %d, flags %#o, mode %#o; want the moved offset 30, O_APPEND|O_NONBLOCK, 0600", data.GetPos(), data.GetFlags(), data.GetMode())
				}
				if got := dumpedPipes(d); !bytes.Contains(bytes.Join(got, nil), []byte("pipe-after")) {
					t.Errorf("dumped pipe data %q, want what the process wrote after the checkpoint", got)
				}
			},
		},
		{
			// The dump sees the files, the cwd and the executable under their new names.
			name: "renamed", mutate: "renamed",
			revert: func(t *testing.T, dir string) {
				for _, p := range []string{"data", "mapped", "work", "bin/python"} {
					if err := os.Rename(filepath.Join(dir, p+".moved"), filepath.Join(dir, p)); err != nil {
						t.Fatal(err)
					}
				}
			},
			dumped: func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string) {
				if want := filepath.Join(dir, "data.moved"); data.GetName() != want {
					t.Errorf("dumped data file named %s, want %s", data.GetName(), want)
				}
			},
		},
		{
			// The dump sees ghosts: the open and the mapped file unlinked (the open one
			// overwritten first), the cwd removed. The checkpoint's filesystem has them.
			name: "deleted", mutate: "deleted",
			revert: func(t *testing.T, dir string) {
				write(t, filepath.Join(dir, "data"), dataContent)
				write(t, filepath.Join(dir, "mapped"), mappedContent)
				if err := os.Mkdir(filepath.Join(dir, "work"), 0o755); err != nil {
					t.Fatal(err)
				}
			},
			dumped: func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string) {
				ghosts := 0
				for _, e := range d.remaps.entries {
					if k, _ := remapKind(e.Message.(*remap_file_path.RemapFilePathEntry)); k == remap_file_path.RemapType_GHOST {
						ghosts++
					}
				}
				// The data file, the mapped file (its mapping and mmap's descriptor), the cwd.
				if ghosts != 4 || len(d.ghosts) != 3 {
					t.Errorf("dump has %d ghost remaps and ghost images %v; want 4 and 3", ghosts, d.ghosts)
				}
			},
		},
		{name: "sibling", mutate: "unchanged", sibling: true},
		{
			// Unlinked while another name links it: CRIU (only with --link-remap) links the
			// file under a temporary name, link_remap.<id>, in the file's directory, and
			// remaps the descriptor's entry to that name. After a --leave-running dump it
			// unlinks that name again: the images name a file that is gone.
			name: "relinked", mutate: "relinked", linkRemap: true,
			revert: func(t *testing.T, dir string) {
				if err := os.Rename(filepath.Join(dir, "data.link"), filepath.Join(dir, "data")); err != nil {
					t.Fatal(err)
				}
				if links, _ := filepath.Glob(filepath.Join(dir, "link_remap.*")); len(links) > 0 {
					t.Errorf("CRIU left link remaps %v after a --leave-running dump", links)
				}
			},
			dumped: func(t *testing.T, d *dump, data *regfile.RegFileEntry, dir string) {
				linked := 0
				for _, e := range d.remaps.entries {
					if k, _ := remapKind(e.Message.(*remap_file_path.RemapFilePathEntry)); k == remap_file_path.RemapType_LINKED {
						linked++
					}
				}
				if linked != 1 {
					t.Errorf("dump has %d linked remaps, want 1", linked)
				}
			},
		},
		{
			// The executable's inode is mapped under another name (a hard link): one file
			// entry in the dump, two paths in the Spec.
			name: "hardlinked", mutate: "unchanged",
			edit: func(s *Spec, dir string) {
				for i, m := range s.Maps {
					if m.Path == filepath.Join(dir, "bin", "python") {
						s.Maps[i].Path += "2"
					}
				}
			},
			revert: func(t *testing.T, dir string) {
				if err := os.Link(filepath.Join(dir, "bin", "python"), filepath.Join(dir, "bin", "python2")); err != nil {
					t.Fatal(err)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := start(t, "holder")
			z := p.fork()
			t.Cleanup(func() { killPid(z) })
			spec, pipes := record(t, p.pid)
			r := p.report()
			spec.PdeathSig, spec.ChildSubreaper, spec.Dumpable = r.Pdeath, r.Subreaper == 1, &r.Dumpable
			if spec.PdeathSig != int(pdeathSig) || !spec.ChildSubreaper || r.Dumpable != 1 || len(spec.Locks) != 2 || r.Owner != p.pid {
				t.Fatalf("the process under test is not set up: %+v", spec)
			}
			p.mutate(tt.mutate)

			var extra []string
			if tt.linkRemap {
				extra = append(extra, "--link-remap")
			}
			images := criuDump(t, criuPath, z, extra...)
			d, err := load(images, uint32(spec.Pid))
			if err != nil {
				t.Fatal(err)
			}
			if st := d.core.entries[0].Message.(*criu_core.CoreEntry).GetTc().GetTaskState(); st != taskStopped || len(d.locks.entries) > 0 {
				t.Errorf("dumped zygote in state %d with %d locks; want stopped, none", st, len(d.locks.entries))
			}
			if tt.dumped != nil {
				tt.dumped(t, d, dataEntry(t, d, spec, p.dir), p.dir)
			}
			if tt.edit != nil {
				tt.edit(&spec, p.dir)
			}
			p.kill() // the process, then its zygote: the PID is free for the restore
			killPid(z)
			if tt.revert != nil {
				tt.revert(t, p.dir)
			}
			// Twice: Apply can be run again on a directory it rewrote (or began to).
			for i := 0; i < 2; i++ {
				if err := Apply(images, spec); err != nil {
					t.Fatalf("Apply #%d: %v", i+1, err)
				}
			}
			if d, err := load(images, uint32(spec.Pid)); err != nil {
				t.Error(err)
			} else {
				for _, e := range d.files.entries {
					if n := e.Message.(*fdinfo.FileEntry).GetReg().GetName(); strings.Contains(n, "link_remap.") {
						t.Errorf("after Apply files.img still has the link remap %s", n)
					}
				}
			}
			if left := leftovers(t, images, z); len(left) > 0 {
				t.Errorf("after Apply the images still have %v", left)
			}
			var opts []string
			if tt.sibling {
				opts = append(opts, "--restore-sibling")
			}
			criuRestore(t, criuPath, images, spec.Pid, opts...)

			checkRestored(t, p, spec, r, pipes, tt.sibling)
		})
	}
}

// checkRestored checks that the restored process is the recorded one (spec, r and
// pipes, recorded at the checkpoint).
func checkRestored(t *testing.T, p *proc, spec Spec, r report, pipes map[int][]byte, sibling bool) {
	t.Helper()
	got := p.report() // the restored process serves the control FIFO
	if got.Pid != spec.Pid || got.Owner != r.Owner {
		t.Errorf("restored process reports PID %d, data file owner %d; want %d, %d", got.Pid, got.Owner, spec.Pid, r.Owner)
	}
	// CRIU sets the parent-death signal while the restored task's parent is still criu,
	// so criu's exit delivers it, once; restored as criu's sibling, the task's parent is
	// criu's (the test, which lives on).
	if want := map[bool]int{false: 1, true: 0}[sibling]; got.PdeathReceived != want {
		t.Errorf("restored process received its parent-death signal %d times since the restore, want %d", got.PdeathReceived, want)
	}
	pid := strconv.Itoa(spec.Pid)
	if st := stat(spec.Pid); len(st) < 4 || st[0] == "T" || st[2] != pid || st[3] != pid {
		t.Errorf("restored /proc/%d/stat: state, ppid, pgrp, session... %v; want running, leading its group and session", spec.Pid, st)
	}
	// The zygote that was dumped is not dumpable; the process is again.
	if spec.Dumpable != nil && got.Dumpable != *spec.Dumpable {
		t.Errorf("restored process is dumpable %d, want %d (the recorded process's, not its zygote's)", got.Dumpable, *spec.Dumpable)
	}
	after, afterPipes := record(t, spec.Pid)
	after.PdeathSig, after.ChildSubreaper, after.Dumpable = got.Pdeath, got.Subreaper == 1, spec.Dumpable
	if diff := cmp.Diff(normalize(spec), normalize(after)); diff != "" {
		t.Errorf("restored process differs from the recorded one (-recorded +restored):\n%s", diff)
	}
	if diff := cmp.Diff(pipes, afterPipes); diff != "" {
		t.Errorf("unread pipe and FIFO bytes by fd (-recorded +restored):\n%s", diff)
	}
	for _, m := range spec.Maps {
		if got := pathAt(t, spec.Pid, m.Start); got != m.Path {
			t.Errorf("mapping at %#x: %q, want %q", m.Start, got, m.Path)
		}
	}
	// The descriptor of the data file reads the checkpoint's file, not the dump's.
	for _, f := range spec.Files {
		if f.Path == filepath.Join(p.dir, "data") {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/fd/%d", spec.Pid, f.Fd))
			if err != nil || !bytes.Equal(b, dataContent) {
				t.Errorf("restored fd %d reads %q, %v; want the checkpoint's %q", f.Fd, b, err, dataContent)
			}
		}
	}
}

// normalize is s without what a restore legitimately renumbers: pipe inodes (the
// pipes' content is compared by descriptor) and mappings (compared by address: the
// kernel may merge restored areas).
func normalize(s Spec) Spec {
	s.Pipes, s.Maps = nil, nil
	files := append([]File(nil), s.Files...)
	for i := range files {
		if strings.HasPrefix(files[i].Path, "pipe:[") {
			files[i].Path = "pipe"
		}
	}
	s.Files = files
	return s
}

// dataEntry returns the dump's entry of the data file's descriptor.
func dataEntry(t *testing.T, d *dump, s Spec, dir string) *regfile.RegFileEntry {
	t.Helper()
	for _, f := range s.Files {
		if f.Path == filepath.Join(dir, "data") {
			if fe := d.fdIndex()[f.Fd]; fe != nil {
				return d.fileByID(fe.GetId()).GetReg()
			}
		}
	}
	t.Fatal("the dump has no descriptor of the data file")
	return nil
}

func dumpedPipes(d *dump) [][]byte {
	var out [][]byte
	for _, e := range d.pipes.entries {
		b, _ := base64.StdEncoding.DecodeString(e.Extra)
		out = append(out, b)
	}
	return out
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// leftovers returns what Apply should have removed: per-task images of the old PID,
// ghosts, remaps, temporary files.
func leftovers(t *testing.T, dir string, oldPid int) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	old := regexp.MustCompile(fmt.Sprintf(`-%d\.img$`, oldPid))
	for _, e := range ents {
		n := e.Name()
		if old.MatchString(n) || strings.HasPrefix(n, "ghost-file-") || n == "remap-fpath.img" || strings.HasSuffix(n, tmpSuffix) {
			out = append(out, n)
		}
	}
	return out
}

// TestApplyRefuses checks that Apply rejects what it cannot rewrite, saying what it
// found, and leaves the directory as it was.
func TestApplyRefuses(t *testing.T) {
	criuPath := require(t)
	p := start(t, "holder")
	z := p.fork()
	t.Cleanup(func() { killPid(z) })
	spec, _ := record(t, p.pid)
	fdOf := func(path string) int {
		for _, f := range spec.Files {
			if f.Path == path {
				return f.Fd
			}
		}
		t.Fatalf("no fd for %s", path)
		return -1
	}
	pipeFd := -1
	for _, f := range spec.Files {
		if strings.HasPrefix(f.Path, "pipe:[") {
			pipeFd = f.Fd
		}
	}
	data := fdOf(filepath.Join(p.dir, "data"))
	zygote := criuDump(t, criuPath, z)
	tree := criuDump(t, criuPath, p.pid) // the process and its zygote
	threads := criuDump(t, criuPath, start(t, "threads").pid)

	tests := []struct {
		name   string
		images string
		spec   Spec
		setup  func(t *testing.T, dir string) // changes the images before Apply
		want   string                         // in the error
	}{
		{name: "two tasks", images: tree, spec: Spec{Pid: p.pid}, want: "holds 2 tasks"},
		{name: "threads", images: threads, spec: Spec{Pid: 1}, want: "has threads"},
		{name: "other process", images: zygote, spec: Spec{Pid: p.pid + 1000}, want: "neither its own PID nor Spec.Pid"},
		{name: "fd not open", images: zygote, spec: Spec{Pid: p.pid, Files: []File{{Fd: 99, Path: "/x"}}}, want: "fd 99 (/x) is not open in the dump"},
		{name: "pipe as a path", images: zygote, spec: Spec{Pid: p.pid, Files: []File{{Fd: pipeFd, Path: "/x"}}}, want: fmt.Sprintf("fd %d is pipe:[", pipeFd)},
		{name: "pipe not open", images: zygote, spec: Spec{Pid: p.pid, Pipes: []Pipe{{Ino: 1, Data: []byte("x")}}}, want: "no pipe or FIFO of inode 1 is open"},
		{name: "nothing mapped", images: zygote, spec: Spec{Pid: p.pid, Maps: []Map{{Start: 0x1000, Path: "/x"}}}, want: "nothing is mapped at 0x1000"},
		{name: "write lock on a read-only fd", images: zygote, spec: Spec{Pid: p.pid, Locks: []Lock{{Fd: data, Write: true}}}, want: fmt.Sprintf("fd %d (%s) is open with access mode 0: it cannot hold a write lock", data, filepath.Join(p.dir, "data"))},
		{name: "lock on a closed fd", images: zygote, spec: Spec{Pid: p.pid, Locks: []Lock{{Fd: 77}}}, want: "fd 77 is not open in the dump"},
		{name: "negative offset", images: zygote, spec: Spec{Pid: p.pid, Files: []File{{Fd: data, Path: "/x", Pos: -1}}}, want: "negative flags or offset"},
		{
			name: "unknown image", images: zygote, spec: Spec{Pid: p.pid}, want: "amdgpu-kfd-1.img is not an image CRIU 4.2 writes",
			setup: func(t *testing.T, dir string) { write(t, filepath.Join(dir, "amdgpu-kfd-1.img"), nil) },
		},
		{
			name: "older CRIU", images: zygote, spec: Spec{Pid: p.pid}, want: fmt.Sprintf("creds-%d.img is a per-task image of a CRIU older than 4.2", z),
			setup: func(t *testing.T, dir string) { write(t, filepath.Join(dir, fmt.Sprintf("creds-%d.img", z)), nil) },
		},
		{
			name: "parent link", images: zygote, spec: Spec{Pid: p.pid}, want: "it has a parent link",
			setup: func(t *testing.T, dir string) {
				if err := os.Symlink("../elsewhere", filepath.Join(dir, "parent")); err != nil {
					t.Fatal(err)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := copyDir(t, tt.images)
			if tt.setup != nil {
				tt.setup(t, dir)
			}
			before := digest(t, dir)
			err := Apply(dir, tt.spec)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Apply: %v; want an error saying %q", err, tt.want)
			}
			t.Logf("%v", err)
			if diff := cmp.Diff(before, digest(t, dir)); diff != "" {
				t.Errorf("a refused Apply changed the directory:\n%s", diff)
			}
		})
	}
}

// TestApplyAgain checks the state an Apply interrupted before its commit (pstree.img)
// leaves: Apply run again gives the same images as one uninterrupted Apply.
func TestApplyAgain(t *testing.T) {
	criuPath := require(t)
	p := start(t, "holder")
	z := p.fork()
	t.Cleanup(func() { killPid(z) })
	spec, _ := record(t, p.pid)
	p.mutate("deleted") // ghosts to drop
	images := criuDump(t, criuPath, z)

	clean := copyDir(t, images)
	if err := Apply(clean, spec); err != nil {
		t.Fatal(err)
	}
	// Interrupted: everything written but pstree.img, nothing removed yet.
	crashed := copyDir(t, clean)
	for _, e := range readDir(t, images) {
		if n := e.Name(); n == "pstree.img" || strings.HasSuffix(n, fmt.Sprintf("-%d.img", z)) || strings.HasPrefix(n, "ghost-file-") || n == "remap-fpath.img" {
			copyFile(t, filepath.Join(images, n), filepath.Join(crashed, n))
		}
	}
	write(t, filepath.Join(crashed, "files.img"+tmpSuffix), []byte("half an image"))
	if err := Apply(crashed, spec); err != nil {
		t.Fatalf("Apply after an interrupted one: %v", err)
	}
	if diff := cmp.Diff(digest(t, clean), digest(t, crashed)); diff != "" {
		t.Errorf("images after an interrupted Apply and another (-clean +again):\n%s", diff)
	}
}

func readDir(t *testing.T, dir string) []os.DirEntry {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	return ents
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	write(t, to, b)
}

func copyDir(t *testing.T, dir string) string {
	t.Helper()
	out := t.TempDir()
	for _, e := range readDir(t, dir) {
		if e.Type().IsRegular() {
			copyFile(t, filepath.Join(dir, e.Name()), filepath.Join(out, e.Name()))
		}
	}
	return out
}

// digest maps each image file of dir to a hash of its content.
func digest(t *testing.T, dir string) map[string]string {
	t.Helper()
	m := map[string]string{}
	var names []string
	for _, e := range readDir(t, dir) {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	for _, n := range names {
		if strings.HasSuffix(n, ".log") || strings.HasPrefix(n, "stats-") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			b = []byte(err.Error()) // the parent symlink
		}
		m[n] = fmt.Sprintf("%x", sha256.Sum256(b))
	}
	return m
}
