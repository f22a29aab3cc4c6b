package template

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// importDir copies the tree at src into dst (existing, empty).
func importDir(ctx context.Context, src, dst string, progress Progress) (string, error) {
	abs, err := filepath.Abs(src)
	if err != nil {
		return "", errdefs.InvalidArgument("template source directory %q: %w", src, err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if os.IsNotExist(err) {
		return "", errdefs.NotFound("template source directory %s does not exist", abs)
	}
	if err != nil {
		return "", errdefs.FailedPrecondition("resolve template source directory %s: %w", abs, err)
	}
	if st, err := os.Stat(real); err != nil || !st.IsDir() {
		return "", errdefs.InvalidArgument("template source %s is not a directory: "+
			"import a directory tree (or use an OCI image for archives)", abs)
	}
	if realDst, err := filepath.EvalSymlinks(dst); err == nil {
		if rel, err := filepath.Rel(real, realDst); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return "", errdefs.InvalidArgument("template target %s lies inside the source %s: "+
				"the copy would contain itself; build the template elsewhere", dst, abs)
		}
	}

	progress.Stage("scanning")
	var total int64
	if err := filepath.WalkDir(real, func(_ string, _ fs.DirEntry, err error) error {
		total++
		return err
	}); err != nil {
		return "", errdefs.FailedPrecondition("scan template source %s: %w", abs, err)
	}

	progress.Stage("copying")
	c := &treeCopier{ctx: ctx, src: real, dst: dst, progress: progress, total: total,
		links: map[[2]uint64]string{}}
	if err := filepath.WalkDir(real, c.visit); err != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("import of %s interrupted: %w", abs, ctx.Err())
		}
		if isClassified(err) {
			return "", err
		}
		return "", errdefs.FailedPrecondition("copy %s into the template: %w", abs, err)
	}
	// Directory times last, children before parents: creating entries in a directory
	// updates its mtime.
	for i := len(c.dirs) - 1; i >= 0; i-- {
		d := c.dirs[i]
		if err := c.setMeta(d.src, d.path, &d.st, false); err != nil {
			return "", err
		}
		if err := setTimes(d.path, &d.st); err != nil {
			return "", errdefs.FailedPrecondition("set times of %s: %w", d.path, err)
		}
	}
	progress.Advance(total, total)
	return "directory " + abs, nil
}

type dirMeta struct {
	src  string
	path string
	st   unix.Stat_t
}

type treeCopier struct {
	ctx      context.Context
	src, dst string
	progress Progress
	done     int64
	total    int64
	links    map[[2]uint64]string // (dev, inode) of multiply-linked sources -> first copy
	dirs     []dirMeta            // in walk (pre-)order
}

func (c *treeCopier) visit(p string, _ fs.DirEntry, err error) error {
	if err != nil {
		return err
	}
	if err := c.ctx.Err(); err != nil {
		return err
	}
	c.done++
	if c.done%64 == 0 {
		c.progress.Advance(c.done, c.total)
	}
	rel, err := filepath.Rel(c.src, p)
	if err != nil {
		return err
	}
	target := filepath.Join(c.dst, rel)
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return &fs.PathError{Op: "lstat", Path: p, Err: err}
	}
	kind := st.Mode & unix.S_IFMT
	if kind != unix.S_IFDIR && st.Nlink > 1 {
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := c.links[key]; ok {
			return os.Link(first, target)
		}
		c.links[key] = target
	}
	switch kind {
	case unix.S_IFDIR:
		if rel != "." {
			// 0700 until the final mode is applied after the children are in.
			if err := os.Mkdir(target, 0o700); err != nil {
				return err
			}
		}
		c.dirs = append(c.dirs, dirMeta{src: p, path: target, st: st})
		return nil // metadata after the walk
	case unix.S_IFREG:
		if err := copyFileData(p, target); err != nil {
			return err
		}
	case unix.S_IFLNK:
		dest, err := os.Readlink(p)
		if err != nil {
			return err
		}
		if err := os.Symlink(dest, target); err != nil {
			return err
		}
	case unix.S_IFCHR, unix.S_IFBLK, unix.S_IFIFO, unix.S_IFSOCK:
		if err := unix.Mknod(target, st.Mode&(unix.S_IFMT|0o7777), int(st.Rdev)); err != nil {
			return &fs.PathError{Op: "mknod", Path: target, Err: err}
		}
	default:
		c.progress.Log(fmt.Sprintf("skipping %s: unknown file type %#o", p, kind))
		return nil
	}
	if err := c.setMeta(p, target, &st, kind == unix.S_IFLNK); err != nil {
		return err
	}
	if err := setTimes(target, &st); err != nil {
		return &fs.PathError{Op: "utimes", Path: target, Err: err}
	}
	return nil
}

// setMeta applies owner, then mode, then xattrs: chown clears setuid bits and
// security.capability, so those must come after it.
func (c *treeCopier) setMeta(src, target string, st *unix.Stat_t, symlink bool) error {
	if err := unix.Lchown(target, int(st.Uid), int(st.Gid)); err != nil {
		if errors.Is(err, unix.EPERM) {
			return errdefs.PermissionDenied("cannot give %s owner %d:%d: run as root to import "+
				"a tree with its ownership", target, st.Uid, st.Gid)
		}
		return &fs.PathError{Op: "lchown", Path: target, Err: err}
	}
	if !symlink { // symlink modes are meaningless on Linux and cannot be changed
		if err := unix.Chmod(target, st.Mode&0o7777); err != nil {
			return &fs.PathError{Op: "chmod", Path: target, Err: err}
		}
	}
	return copyXattrs(src, target, c.progress)
}

func setTimes(target string, st *unix.Stat_t) error {
	ts := []unix.Timespec{st.Atim, st.Mtim}
	return unix.UtimesNanoAt(unix.AT_FDCWD, target, ts, unix.AT_SYMLINK_NOFOLLOW)
}

// copyFileData copies a regular file's bytes, sharing extents (FICLONE) when source and
// target are on the same reflink-capable filesystem; io.Copy falls back to
// copy_file_range or plain reads.
func copyFileData(src, dst string) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := unix.IoctlFileClone(int(out.Fd()), int(in.Fd())); err != nil {
		if _, err := io.Copy(out, in); err != nil {
			out.Close()
			return fmt.Errorf("copy %s: %w", src, err)
		}
	}
	return out.Close()
}

// copyXattrs copies extended attributes where the target filesystem and our privileges
// allow; an attribute that cannot be set is reported via progress, not fatal, because
// e.g. SELinux labels of the host are not meaningful in a template.
func copyXattrs(src, dst string, progress Progress) error {
	names, err := listXattrs(src)
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil
		}
		return &fs.PathError{Op: "listxattr", Path: src, Err: err}
	}
	for _, name := range names {
		val, err := getXattr(src, name)
		if err != nil {
			return &fs.PathError{Op: "getxattr " + name, Path: src, Err: err}
		}
		if err := unix.Lsetxattr(dst, name, val, 0); err != nil {
			progress.Log(fmt.Sprintf("xattr %s of %s not copied: %v", name, src, err))
		}
	}
	return nil
}

func listXattrs(p string) ([]string, error) {
	for size := 256; ; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) && size < 1<<20 {
			continue
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, nm := range strings.Split(string(buf[:n]), "\x00") {
			if nm != "" {
				names = append(names, nm)
			}
		}
		return names, nil
	}
}

func getXattr(p, name string) ([]byte, error) {
	for size := 256; ; size *= 4 {
		buf := make([]byte, size)
		n, err := unix.Lgetxattr(p, name, buf)
		if errors.Is(err, unix.ERANGE) && size < 1<<20 {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}
