package template

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
	"github.com/cairn-sandbox/cairn/internal/testenv/prereq"
)

// requireRoot skips tests that need root (chown, mknod) on developer machines; CI
// runs as root, so there a missing privilege is a failure.
func requireRoot(t *testing.T) {
	t.Helper()
	prereq.Root(t, "template tests need root (chown, mknod: files owned by other users, device nodes)")
}

// entry is one line of a tree listing.
type entry struct {
	Path     string
	Mode     string
	UID, GID uint32
	Size     int64  // regular files only
	Link     string // symlink target
}

func listing(t *testing.T, root string) []entry {
	t.Helper()
	var out []entry
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, _ := d.Info()
		e := entry{Path: rel, Mode: fi.Mode().String(), UID: st.Uid, GID: st.Gid}
		switch {
		case fi.Mode().IsRegular():
			e.Size = st.Size
		case fi.Mode()&fs.ModeSymlink != 0:
			e.Link, _ = os.Readlink(p)
		}
		out = append(out, e)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func ino(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	must(t, unix.Lstat(p, &st))
	return st.Ino
}

func TestImportDir(t *testing.T) {
	requireRoot(t)
	src, dst := t.TempDir(), t.TempDir()
	must(t, os.Chmod(src, 0o755))
	must(t, os.MkdirAll(filepath.Join(src, "a/b/c"), 0o750))
	must(t, os.WriteFile(filepath.Join(src, "a/b/c/deep.txt"), []byte("deep\n"), 0o644))
	must(t, os.WriteFile(filepath.Join(src, "secret"), []byte("s3cr3t"), 0o600))
	must(t, os.Chown(filepath.Join(src, "secret"), 1234, 1234))
	must(t, os.Link(filepath.Join(src, "secret"), filepath.Join(src, "hard")))
	must(t, os.Symlink("a/b/c/deep.txt", filepath.Join(src, "link")))
	must(t, unix.Mkfifo(filepath.Join(src, "fifo"), 0o620))
	must(t, unix.Mknod(filepath.Join(src, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	must(t, unix.Chmod(filepath.Join(src, "fifo"), 0o620)) // undo the umask
	must(t, unix.Chmod(filepath.Join(src, "null"), 0o666))
	must(t, os.WriteFile(filepath.Join(src, "suid"), []byte("#!/bin/sh\n"), 0o755))
	must(t, os.Chown(filepath.Join(src, "suid"), 0, 1234))
	must(t, os.Chmod(filepath.Join(src, "suid"), 0o4755|fs.ModeSetuid))
	old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	must(t, os.Chtimes(filepath.Join(src, "a/b"), old, old))

	info, err := Build(context.Background(), Spec{Name: "dir-test", Dir: src}, dst, nil)
	must(t, err)

	want := []entry{
		{Path: ".", Mode: "drwxr-xr-x"},
		{Path: "a", Mode: "drwxr-x---"},
		{Path: "a/b", Mode: "drwxr-x---"},
		{Path: "a/b/c", Mode: "drwxr-x---"},
		{Path: "a/b/c/deep.txt", Mode: "-rw-r--r--", Size: 5},
		{Path: "fifo", Mode: "prw--w----"},
		{Path: "hard", Mode: "-rw-------", UID: 1234, GID: 1234, Size: 6},
		{Path: "link", Mode: "Lrwxrwxrwx", Link: "a/b/c/deep.txt"},
		{Path: "null", Mode: "Dcrw-rw-rw-"},
		{Path: "secret", Mode: "-rw-------", UID: 1234, GID: 1234, Size: 6},
		{Path: "suid", Mode: "urwxr-xr-x", GID: 1234, Size: 10},
		{Path: "workspace", Mode: "drwxr-xr-x"},
	}
	if diff := cmp.Diff(want, listing(t, dst)); diff != "" {
		t.Errorf("imported tree (-want +got):\n%s", diff)
	}
	if ino(t, filepath.Join(dst, "hard")) != ino(t, filepath.Join(dst, "secret")) {
		t.Error("hardlink not preserved: hard and secret are distinct inodes")
	}
	if st, err := os.Stat(filepath.Join(dst, "a/b")); err != nil || !st.ModTime().Equal(old) {
		t.Errorf("directory mtime not preserved: %v, %v", st.ModTime(), err)
	}
	var st unix.Stat_t
	must(t, unix.Lstat(filepath.Join(dst, "null"), &st))
	if unix.Major(st.Rdev) != 1 || unix.Minor(st.Rdev) != 3 {
		t.Errorf("device number %d:%d, want 1:3", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	}
	wantInfo := Info{Name: "dir-test", Source: "directory " + src, Bytes: 5 + 6 + 10, Files: 11}
	if diff := cmp.Diff(wantInfo, *info); diff != "" {
		t.Errorf("info (-want +got):\n%s", diff)
	}
}

func TestBuildRejects(t *testing.T) {
	requireRoot(t)
	file := filepath.Join(t.TempDir(), "file")
	must(t, os.WriteFile(file, nil, 0o644))
	full := t.TempDir()
	must(t, os.WriteFile(filepath.Join(full, "x"), nil, 0o644))
	src := t.TempDir()
	for _, tc := range []struct {
		name string
		spec Spec
		dir  string
		want error
	}{
		{"file source", Spec{Name: "t", Dir: file}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"missing source", Spec{Name: "t", Dir: file + ".nope"}, t.TempDir(), errdefs.ErrNotFound},
		{"target in source", Spec{Name: "t", Dir: src}, mkdir(t, src, "inner"), errdefs.ErrInvalidArgument},
		{"non-empty target", Spec{Name: "t", Dir: src}, full, errdefs.ErrFailedPrecondition},
		{"missing target", Spec{Name: "t", Dir: src}, full + "/nope", errdefs.ErrNotFound},
		{"relative target", Spec{Name: "t", Dir: src}, "rel", errdefs.ErrInvalidArgument},
		{"bad name", Spec{Name: "Bad", Dir: src}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"long name", Spec{Name: strings.Repeat("a", 64), Dir: src}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"two sources", Spec{Name: "t", Dir: src, OCI: file}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"no source", Spec{Name: "t"}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"bad package", Spec{Name: "t", Debian: &DebianSource{Packages: []string{"--evil"}}}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"bad mirror", Spec{Name: "t", Debian: &DebianSource{Mirror: "ftp://x/debian"}}, t.TempDir(), errdefs.ErrInvalidArgument},
		{"missing image", Spec{Name: "t", OCI: file + ".nope"}, t.TempDir(), errdefs.ErrNotFound},
		{"not an image", Spec{Name: "t", OCI: file}, t.TempDir(), errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Build(context.Background(), tc.spec, tc.dir, nil)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Build: %v, want class %v", err, tc.want)
			}
			t.Log(err)
		})
	}
	if err := Default().Validate(); err != nil {
		t.Errorf("default spec invalid: %v", err)
	}
}

func mkdir(t *testing.T, parent, name string) string {
	p := filepath.Join(parent, name)
	must(t, os.Mkdir(p, 0o755))
	return p
}

// tarLayer builds an uncompressed layer from tar headers; regular files get body as
// content, everything else none.
func tarLayer(t *testing.T, entries ...tar.Header) v1.Layer {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range entries {
		h := h
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		body := []byte(nil)
		if h.Typeflag == tar.TypeReg {
			body = []byte("content of " + h.Name)
			h.Size = int64(len(body))
		}
		must(t, tw.WriteHeader(&h))
		_, err := tw.Write(body)
		must(t, err)
	}
	must(t, tw.Close())
	data := buf.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(data)), nil
	})
	must(t, err)
	return l
}

func dirH(name string) tar.Header  { return tar.Header{Name: name, Typeflag: tar.TypeDir} }
func fileH(name string) tar.Header { return tar.Header{Name: name, Typeflag: tar.TypeReg} }

// writeImage saves img as an OCI layout and as a docker-save tarball.
func writeImage(t *testing.T, img v1.Image) (layoutDir, tarPath string) {
	t.Helper()
	base := t.TempDir()
	layoutDir = filepath.Join(base, "layout")
	_, err := layout.Write(layoutDir, mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: img}))
	must(t, err)
	tarPath = filepath.Join(base, "image.tar")
	must(t, tarball.WriteToFile(tarPath, name.MustParseReference("cairn.test/img:1"), img))
	return layoutDir, tarPath
}

func TestImportOCI(t *testing.T) {
	requireRoot(t)
	l1 := tarLayer(t, dirH("a/"), fileH("a/f1"), dirH("b/"), fileH("b/f2"), dirH("b/sub/"), fileH("b/sub/f4"),
		tar.Header{Name: "c/keep", Typeflag: tar.TypeReg, Mode: 0o640, Uid: 42, Gid: 43},
		tar.Header{Name: "c/abs", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"},
		tar.Header{Name: "c/hard", Typeflag: tar.TypeLink, Linkname: "c/keep"},
		tar.Header{Name: "c/fifo", Typeflag: tar.TypeFifo, Mode: 0o600})
	l2 := tarLayer(t, fileH("a/.wh.f1"), dirH("b/"), fileH("b/.wh..wh..opq"), fileH("b/f3"))
	img, err := mutate.AppendLayers(empty.Image, l1, l2)
	must(t, err)
	layoutDir, tarPath := writeImage(t, img)

	want := []entry{
		{Path: ".", Mode: "drwxr-xr-x"},
		{Path: "a", Mode: "drwxr-xr-x"},
		{Path: "b", Mode: "drwxr-xr-x"},
		{Path: "b/f3", Mode: "-rw-r--r--", Size: int64(len("content of b/f3"))},
		{Path: "c", Mode: "drwxr-xr-x"}, // implicit parent
		{Path: "c/abs", Mode: "Lrwxrwxrwx", Link: "/etc/passwd"},
		{Path: "c/fifo", Mode: "prw-------"},
		{Path: "c/hard", Mode: "-rw-r-----", UID: 42, GID: 43, Size: int64(len("content of c/keep"))},
		{Path: "c/keep", Mode: "-rw-r-----", UID: 42, GID: 43, Size: int64(len("content of c/keep"))},
		{Path: "workspace", Mode: "drwxr-xr-x"},
	}
	for _, src := range []string{layoutDir, tarPath} {
		t.Run(filepath.Base(src), func(t *testing.T) {
			dst := t.TempDir()
			must(t, os.Chmod(dst, 0o755))
			info, err := Build(context.Background(), Spec{Name: "oci", OCI: src}, dst, nil)
			must(t, err)
			if diff := cmp.Diff(want, listing(t, dst)); diff != "" {
				t.Errorf("imported tree (-want +got):\n%s", diff)
			}
			if ino(t, filepath.Join(dst, "c/hard")) != ino(t, filepath.Join(dst, "c/keep")) {
				t.Error("hardlink not preserved")
			}
			t.Logf("info: %+v", *info)
		})
	}
}

// TestImportOCIMalicious checks that no layer can write or delete outside the target.
func TestImportOCIMalicious(t *testing.T) {
	requireRoot(t)
	outside := t.TempDir()
	must(t, os.WriteFile(filepath.Join(outside, "keep"), []byte("host file"), 0o644))
	must(t, os.Chmod(outside, 0o711))
	in := strings.TrimPrefix(outside, "/") // where outside's path resolves inside the root
	for _, tc := range []struct {
		name    string
		layer   []tar.Header
		wantErr error  // nil: must succeed
		landed  string // with wantErr nil: where "escape" must land, relative to dst
	}{
		{"dotdot", []tar.Header{fileH("../escape")}, errdefs.ErrInvalidArgument, ""},
		{"nested dotdot", []tar.Header{dirH("x/"), fileH("x/../../escape")}, errdefs.ErrInvalidArgument, ""},
		{"absolute dotdot", []tar.Header{fileH("/../escape")}, errdefs.ErrInvalidArgument, ""},
		{"whiteout of dot", []tar.Header{fileH("a/.wh..")}, errdefs.ErrInvalidArgument, ""},
		{"hardlink out", []tar.Header{{Name: "h", Typeflag: tar.TypeLink, Linkname: "../../../" + outside + "/keep"}},
			errdefs.ErrInvalidArgument, ""},
		// Symlinks resolve inside the root, as they will in the sandbox: writes through
		// them land under dst, never in outside itself.
		{"absolute symlink", []tar.Header{
			dirH(in + "/"),
			{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: outside},
			fileH("evil/escape"), fileH("evil/.wh.keep"), dirH("evil/d/"),
		}, nil, in + "/escape"},
		{"relative symlink", []tar.Header{
			dirH(in + "/"),
			{Name: "d/evil", Typeflag: tar.TypeSymlink, Linkname: "../../../../../../.." + outside},
			fileH("d/evil/escape"), fileH("d/evil/.wh.keep"), fileH("d/evil/.wh..wh..opq"),
		}, nil, in + "/escape"},
		{"symlink through symlink", []tar.Header{
			dirH(in + "/"),
			{Name: "l1", Typeflag: tar.TypeSymlink, Linkname: "/"},
			{Name: "l1/l2", Typeflag: tar.TypeSymlink, Linkname: "../../.." + outside},
			fileH("l1/l2/escape"),
		}, nil, in + "/escape"},
		{"hardlink through symlink", []tar.Header{
			{Name: "up", Typeflag: tar.TypeSymlink, Linkname: "../../../../../.."},
			{Name: "escape", Typeflag: tar.TypeLink, Linkname: "up" + outside + "/keep"},
		}, errdefs.ErrInvalidArgument, ""},
		// A symlink to a directory absent from the image cannot be written through.
		{"dangling symlink", []tar.Header{
			{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: outside},
			fileH("evil/escape"),
		}, errdefs.ErrInvalidArgument, ""},
		{"whiteout through dangling symlink", []tar.Header{
			{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: outside},
			fileH("evil/.wh.keep"), fileH("evil/.wh..wh..opq"),
		}, errdefs.ErrInvalidArgument, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			img, err := mutate.AppendLayers(empty.Image, tarLayer(t, tc.layer...))
			must(t, err)
			layoutDir, _ := writeImage(t, img)
			dst := t.TempDir()
			_, err = Build(context.Background(), Spec{Name: "evil", OCI: layoutDir}, dst, nil)
			t.Log(err)
			switch {
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Errorf("Build: %v, want class %v", err, tc.wantErr)
			case tc.wantErr == nil && err != nil:
				t.Errorf("Build: %v", err)
			case tc.wantErr == nil:
				if _, err := os.Lstat(filepath.Join(dst, tc.landed)); err != nil {
					t.Errorf("write through symlink did not land inside the root: %v", err)
				}
			}
			want := []entry{{Path: ".", Mode: "drwx--x--x"}, {Path: "keep", Mode: "-rw-r--r--", Size: 9}}
			if diff := cmp.Diff(want, listing(t, outside)); diff != "" {
				t.Fatalf("outside directory changed (-want +got):\n%s", diff)
			}
			if _, err := os.Stat(filepath.Join(filepath.Dir(dst), "escape")); err == nil {
				t.Fatal("escape written next to the target")
			}
		})
	}
}

func TestMirrorFromSources(t *testing.T) {
	dir := t.TempDir()
	deb822 := filepath.Join(dir, "debian.sources")
	must(t, os.WriteFile(deb822, []byte(`# comment
Types: deb
URIs: http://security-mirror.test/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src-only.test/debian
Suites: bookworm

Types: deb
URIs: http://disabled.test/debian
Suites: bookworm
Enabled: no

Types: deb deb-src
# a comment inside the stanza
URIs: http://third-party.test/repo
Suites: stable
Components: main

Types: deb
URIs: http://apt-primary.test/debian
Suites: bookworm bookworm-updates
Components: main
`), 0o644))
	list := filepath.Join(dir, "sources.list")
	must(t, os.WriteFile(list, []byte(`# deb http://commented.test/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://apt-list.test/debian trixie main
deb http://apt-list.test/debian-security trixie-security main
`), 0o644))

	for _, tc := range []struct {
		suite string
		files []string
		want  string
	}{
		{"bookworm", []string{deb822, list}, "http://apt-primary.test/debian"},
		{"trixie", []string{deb822, list}, "http://apt-list.test/debian"},
		{"sid", []string{deb822, list}, "http://third-party.test/repo"}, // no match: first usable
		{"bookworm", []string{list, filepath.Join(dir, "absent.sources")}, "http://apt-list.test/debian"},
	} {
		got, err := MirrorFromSources(tc.suite, tc.files...)
		if err != nil || got != tc.want {
			t.Errorf("MirrorFromSources(%s, %v) = %q, %v; want %q", tc.suite, tc.files, got, err, tc.want)
		}
	}
	if _, err := MirrorFromSources("bookworm", filepath.Join(dir, "absent.sources")); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("no sources: %v, want not found", err)
	}
}

// recorder is a Progress that remembers what it was told.
type recorder struct {
	stages      []string
	done, total int64
	lines       int
}

func (r *recorder) Stage(s string) { r.stages = append(r.stages, s) }
func (r *recorder) Advance(d, t int64) {
	if d > t && t > 0 {
		panic("done beyond total")
	}
	r.done, r.total = d, t
}
func (r *recorder) Log(string) { r.lines++ }

func TestDebootstrapTracker(t *testing.T) {
	out := `I: Retrieving InRelease
I: Checking Release signature
I: Valid Release signature (key id 4D64FEC119C2029067D6E791F8D2585B8783D481)
I: Retrieving Packages
I: Validating Packages
I: Resolving dependencies of required packages...
I: Retrieving adduser 3.134
I: Validating adduser 3.134
I: Retrieving base-files 12.4+deb12u10
I: Validating base-files 12.4+deb12u10
I: Chosen extractor for .deb packages: dpkg-deb
I: Extracting base-files...
I: Installing core packages...
I: Unpacking required packages...
I: Unpacking base-files...
I: Configuring required packages...
I: Configuring base-files...
I: Unpacking the base system...
I: Unpacking adduser...
I: Configuring the base system...
I: Configuring adduser...
I: Base system installed successfully.`
	r := &recorder{}
	tr := &debootstrapTracker{progress: r}
	for _, l := range strings.Split(out, "\n") {
		tr.line(l)
	}
	if diff := cmp.Diff([]string{"retrieving", "extracting", "unpacking", "configuring", "unpacking", "configuring"}, r.stages); diff != "" {
		t.Errorf("stages (-want +got):\n%s", diff)
	}
	if r.total != 9 || r.done != 8 {
		t.Errorf("progress %d/%d, want 8/9 (complete only on success)", r.done, r.total)
	}
	if len(tr.tail) != tailLines && len(tr.tail) != len(strings.Split(out, "\n")) {
		t.Errorf("tail has %d lines", len(tr.tail))
	}

	err := classifyDebootstrap(errors.New("exit status 1"), []string{"E: Couldn't find these debs: nosuchpkg"}, t.TempDir())
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "nosuchpkg") {
		t.Errorf("missing package: %v", err)
	}
	err = classifyDebootstrap(errors.New("exit status 1"), []string{"E: Failed getting release file http://x.test/dists/bookworm/Release"}, t.TempDir())
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("mirror down: %v", err)
	}
	err = classifyDebootstrap(errors.New("exit status 1"), []string{"W: something odd"}, t.TempDir())
	if errdefs.Code(err) != "internal" || strings.Contains(err.Error(), ": internal") {
		t.Errorf("other failure: %v", err)
	}
}

func TestBarProgressPlain(t *testing.T) {
	var buf bytes.Buffer
	bp := NewBarProgress(&buf)
	bp.Stage("retrieving")
	bp.Advance(1, 10)
	bp.Log("I: Retrieving x 1")
	bp.Stage("unpacking")
	bp.Close(true)
	if got, want := buf.String(), "template: retrieving\ntemplate: unpacking\n"; got != want {
		t.Errorf("plain output %q, want %q", got, want)
	}
}

// mountsUnder lists mount points below dir.
func mountsUnder(t *testing.T, dir string) []string {
	data, err := os.ReadFile("/proc/self/mountinfo")
	must(t, err)
	var out []string
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append(out, f[4])
		}
	}
	return out
}

// buildDir makes a directory under /var/tmp (real disk, unlike a tmpfs /tmp) and
// removes it afterwards, refusing if anything is still mounted inside it.
func buildDir(t *testing.T) string {
	dir, err := os.MkdirTemp("/var/tmp", "cairn-template-test-")
	must(t, err)
	must(t, os.Chmod(dir, 0o755))
	t.Cleanup(func() {
		if m := mountsUnder(t, dir); len(m) > 0 {
			t.Errorf("mounts left under %s: %v; not removing it", dir, m)
			return
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return dir
}

// TestDebootstrap runs a real debootstrap (about a minute and 270 MB, network to the
// machine's apt mirror); opt in with CAIRN_TEST_DEBOOTSTRAP=1.
func TestDebootstrap(t *testing.T) {
	if os.Getenv("CAIRN_TEST_DEBOOTSTRAP") != "1" {
		t.Skip("set CAIRN_TEST_DEBOOTSTRAP=1 to run debootstrap (~70 s, ~270 MB)")
	}
	requireRoot(t)

	t.Run("cancel", func(t *testing.T) {
		dir := buildDir(t)
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
		defer cancel()
		_, err := Build(ctx, Spec{Name: "cancelled", Debian: &DebianSource{}}, dir, nil)
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Build: %v, want deadline exceeded", err)
		}
		if m := mountsUnder(t, dir); len(m) > 0 {
			t.Fatalf("mounts left after cancel: %v", m)
		}
	})

	t.Run("build", func(t *testing.T) {
		dir := buildDir(t)
		r := &recorder{}
		start := time.Now()
		info, err := Build(context.Background(), Spec{Name: "bookworm-min", Debian: &DebianSource{}}, dir, r)
		must(t, err)
		t.Logf("debootstrap build took %v: %d files, %d bytes, %d packages, stages %v, progress %d/%d, %d log lines",
			time.Since(start).Round(time.Second), info.Files, info.Bytes, len(info.Packages), r.stages, r.done, r.total, r.lines)
		t.Logf("source: %s", info.Source)
		if b, err := os.ReadFile(filepath.Join(dir, "etc/hostname")); err != nil || string(b) != "cairn\n" {
			t.Errorf("/etc/hostname = %q, %v", b, err)
		}
		if st, err := os.Stat(filepath.Join(dir, "etc/machine-id")); err != nil || st.Size() != 0 {
			t.Errorf("/etc/machine-id not empty: %v", err)
		}
		if debs, _ := filepath.Glob(filepath.Join(dir, "var/cache/apt/archives/*.deb")); len(debs) > 0 {
			t.Errorf("%d .debs left in the apt cache", len(debs))
		}
		if st, err := os.Stat(filepath.Join(dir, "workspace")); err != nil || st.Mode() != fs.ModeDir|0o755 {
			t.Errorf("/workspace: %v %v", st.Mode(), err)
		}
		found := false
		for _, p := range info.Packages {
			found = found || strings.HasPrefix(p, "base-files=")
		}
		if !found {
			t.Errorf("base-files missing from packages %v", info.Packages)
		}
		if r.done != r.total || r.total == 0 {
			t.Errorf("progress ended at %d/%d", r.done, r.total)
		}
		if m := mountsUnder(t, dir); len(m) > 0 {
			t.Errorf("mounts left after build: %v", m)
		}
	})
}
