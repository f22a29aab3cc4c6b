// Package template builds cairn templates: the root filesystems that sandboxes start
// from.
//
// A template is built by populating an existing, empty directory that the caller owns
// (in cairn, a freshly created writable volume that is frozen once Build returns). The
// tree comes from exactly one source:
//
//   - Debian: a debootstrap run against the machine's own apt mirror;
//   - Dir: a copy of a directory tree, preserving owners, modes, times, xattrs,
//     hardlinks, symlinks, device nodes and fifos;
//   - OCI: an OCI image layout directory or a `docker save` tarball, whose layers are
//     applied in order with whiteouts, confined to the target directory.
//
// Every template gets a /workspace directory (mode 0755), the sandbox's working
// directory by convention. Build never deletes dir on failure: the caller created it and
// disposes of it (partially populated trees are expected after an error).
package template

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// Spec describes how a template is built. Exactly one of Debian, Dir and OCI is set.
type Spec struct {
	// Name is the template's name: lowercase [a-z0-9][a-z0-9._-]*, at most 63 chars.
	Name string
	// Debian builds the tree with debootstrap.
	Debian *DebianSource
	// Dir imports (copies) a directory tree from the host.
	Dir string
	// OCI imports an OCI image layout directory or a `docker save` tarball (.tar).
	OCI string
}

// DebianSource configures a debootstrap build. Zero fields take the defaults.
type DebianSource struct {
	Suite    string   // default "bookworm"
	Variant  string   // debootstrap --variant; default "minbase"
	Packages []string // extra packages (--include)
	Mirror   string   // default: the machine's first non-security apt source
}

// Info describes a built template.
type Info struct {
	Name   string
	Source string // human description of where the tree came from
	// Packages lists the Debian packages installed in the tree as "name=version",
	// read from its dpkg database (empty if the tree has none).
	Packages []string
	Bytes    int64 // apparent size of regular files, hardlinked files counted once
	Files    int64 // entries of every type below the root (root excluded)
}

// DefaultName is the name of the default template.
const DefaultName = "debian"

// Default returns the spec of the default template "debian": Debian bookworm minbase
// with the tools agents reach for first.
func Default() Spec {
	return Spec{
		Name: DefaultName,
		Debian: &DebianSource{
			Suite:    "bookworm",
			Variant:  "minbase",
			Packages: []string{"python3", "git", "sqlite3", "procps", "ca-certificates"},
		},
	}
}

var nameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]*$`)

// ValidateName checks a template name.
func ValidateName(name string) error {
	if len(name) == 0 || len(name) > 63 || !nameRE.MatchString(name) {
		return errdefs.InvalidArgument("template name %q is invalid: use 1 to 63 characters "+
			"from a-z, 0-9, '.', '_' and '-', starting with a letter or digit", name)
	}
	return nil
}

// Validate checks the spec without touching the filesystem.
func (s Spec) Validate() error {
	if err := ValidateName(s.Name); err != nil {
		return err
	}
	n := 0
	if s.Debian != nil {
		n++
	}
	if s.Dir != "" {
		n++
	}
	if s.OCI != "" {
		n++
	}
	if n != 1 {
		return errdefs.InvalidArgument("template %q must have exactly one source "+
			"(Debian, Dir or OCI), it has %d", s.Name, n)
	}
	if s.Debian != nil {
		return s.Debian.validate()
	}
	return nil
}

// Build populates dir, which must exist and be empty, from spec and describes the
// result. Progress may be nil. Cancelling ctx stops the build (debootstrap is killed)
// and leaves a partial tree in dir for the caller to delete.
func Build(ctx context.Context, spec Spec, dir string, progress Progress) (*Info, error) {
	if progress == nil {
		progress = Nop()
	}
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	if err := checkEmptyDir(dir); err != nil {
		return nil, err
	}
	var (
		source string
		err    error
	)
	switch {
	case spec.Debian != nil:
		source, err = buildDebian(ctx, *spec.Debian, dir, progress)
	case spec.Dir != "":
		source, err = importDir(ctx, spec.Dir, dir, progress)
	default:
		source, err = importOCI(ctx, spec.OCI, dir, progress)
	}
	if err != nil {
		return nil, err
	}
	if err := ensureWorkspace(dir); err != nil {
		return nil, err
	}
	progress.Stage("measuring")
	info := &Info{Name: spec.Name, Source: source}
	if info.Bytes, info.Files, err = measure(ctx, dir); err != nil {
		return nil, err
	}
	if info.Packages, err = dpkgPackages(dir); err != nil {
		return nil, err
	}
	return info, nil
}

func checkEmptyDir(dir string) error {
	if !filepath.IsAbs(dir) {
		return errdefs.InvalidArgument("template target %q must be an absolute path", dir)
	}
	f, err := os.Open(dir)
	if os.IsNotExist(err) {
		return errdefs.NotFound("template target directory %s does not exist: create it first", dir)
	}
	if err != nil {
		return errdefs.FailedPrecondition("cannot open template target %s: %w", dir, err)
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.IsDir() {
		return errdefs.InvalidArgument("template target %s is not a directory", dir)
	}
	names, err := f.Readdirnames(1)
	if err != nil && !errors.Is(err, io.EOF) {
		return errdefs.FailedPrecondition("cannot read template target %s: %w", dir, err)
	}
	if len(names) > 0 {
		return errdefs.FailedPrecondition("template target %s is not empty (contains %q): "+
			"build into a fresh empty directory", dir, names[0])
	}
	return nil
}

// ensureWorkspace makes /workspace a real 0755 root-owned directory. An image may ship
// /workspace as a symlink or file; it is replaced rather than followed, because following
// an image-controlled link from the host could touch files outside the tree.
func ensureWorkspace(root string) error {
	p := filepath.Join(root, "workspace")
	st, err := os.Lstat(p)
	if err == nil && !st.IsDir() {
		if err := os.Remove(p); err != nil {
			return errdefs.FailedPrecondition("replace non-directory /workspace in %s: %w", root, err)
		}
	}
	if err := os.Mkdir(p, 0o755); err != nil && !os.IsExist(err) {
		return errdefs.FailedPrecondition("create /workspace in %s: %w", root, err)
	}
	if err := os.Chmod(p, 0o755); err != nil {
		return errdefs.FailedPrecondition("chmod /workspace in %s: %w", root, err)
	}
	return nil
}

// measure walks the tree without following symlinks.
func measure(ctx context.Context, root string) (bytes, files int64, err error) {
	seen := map[[2]uint64]bool{}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == root {
			return nil
		}
		files++
		if files%4096 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		if !d.Type().IsRegular() {
			return nil
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if st.Nlink > 1 {
			key := [2]uint64{st.Dev, st.Ino}
			if seen[key] {
				return nil
			}
			seen[key] = true
		}
		bytes += st.Size
		return nil
	})
	if err != nil {
		return 0, 0, fmt.Errorf("measure template tree %s: %w", root, err)
	}
	return bytes, files, nil
}

// dpkgPackages reads the installed packages from the tree's dpkg status file. The path
// is resolved inside the tree (openat2 RESOLVE_IN_ROOT) because imported images control
// their own symlinks.
func dpkgPackages(root string) ([]string, error) {
	data, err := readFileInRoot(root, "var/lib/dpkg/status")
	if err != nil {
		return nil, nil // no dpkg database: not a Debian-like tree
	}
	var pkgs []string
	for _, stanza := range strings.Split(string(data), "\n\n") {
		var name, version, status string
		for _, line := range strings.Split(stanza, "\n") {
			k, v, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			switch k {
			case "Package":
				name = strings.TrimSpace(v)
			case "Version":
				version = strings.TrimSpace(v)
			case "Status":
				status = strings.TrimSpace(v)
			}
		}
		if name != "" && strings.HasSuffix(status, " installed") {
			pkgs = append(pkgs, name+"="+version)
		}
	}
	sort.Strings(pkgs)
	return pkgs, nil
}

func readFileInRoot(root, rel string) ([]byte, error) {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(rfd)
	fd, err := unix.Openat2(rfd, rel, &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), rel)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("%s is not a regular file", rel)
	}
	return io.ReadAll(f)
}

// isClassified reports whether err already carries an errdefs class.
func isClassified(err error) bool {
	return errdefs.Code(err) != "internal" || errors.Is(err, errdefs.ErrInternal)
}
