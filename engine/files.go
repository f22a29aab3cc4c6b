package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"

	"github.com/cairn-sandbox/cairn/engine/model"
	"github.com/cairn-sandbox/cairn/errdefs"
)

// MaxFileSize bounds ReadFile and WriteFile.
const MaxFileSize = 256 << 20

// cleanPath validates a path given from outside a sandbox and returns it relative to the
// sandbox root. Paths are absolute or relative to "/"; ".." is refused outright.
func cleanPath(p string) (string, error) {
	if p == "" {
		return "", errdefs.InvalidArgument("empty path")
	}
	if strings.ContainsRune(p, 0) {
		return "", errdefs.InvalidArgument("path contains a NUL byte")
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." {
			return "", errdefs.InvalidArgument("path %q contains \"..\"; give a path inside the sandbox", p)
		}
	}
	rel := strings.TrimPrefix(path.Clean("/"+p), "/")
	if rel == "" {
		rel = "."
	}
	return rel, nil
}

// inRoot opens the sandbox's root as an os.Root: every access through it resolves
// symlinks but refuses any that leads out of the root.
func (e *Engine) inRoot(ctx context.Context, id, p string) (*os.Root, string, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, "", err
	}
	rel, err := cleanPath(p)
	if err != nil {
		return nil, "", err
	}
	r, err := os.OpenRoot(e.pool.Path(sb.Root))
	if err != nil {
		return nil, "", err
	}
	return r, rel, nil
}

// fileErr classifies an error of an access through an os.Root.
func fileErr(p string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return errdefs.NotFound("%s: no such file or directory in the sandbox", p)
	case errors.Is(err, fs.ErrExist):
		return errdefs.AlreadyExists("%s exists", p)
	case strings.Contains(err.Error(), "escapes from parent"), strings.Contains(err.Error(), "path escapes"):
		return errdefs.PermissionDenied("%s leads out of the sandbox root (through a symlink); refused", p)
	case errors.Is(err, fs.ErrPermission):
		return errdefs.PermissionDenied("%s: %v", p, err)
	}
	return fmt.Errorf("%s: %w", p, err)
}

// ReadFile reads a file of a sandbox.
func (e *Engine) ReadFile(ctx context.Context, id, p string) ([]byte, error) {
	r, rel, err := e.inRoot(ctx, id, p)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	f, err := r.Open(rel)
	if err != nil {
		return nil, fileErr(p, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.IsDir() {
		return nil, errdefs.InvalidArgument("%s is a directory; list it with `cairn files ls`", p)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if len(b) > MaxFileSize {
		return nil, errdefs.ResourceExhausted("%s is larger than %d bytes", p, MaxFileSize)
	}
	return b, fileErr(p, err)
}

// WriteFile writes a file of a sandbox (creating parent directories), replacing it
// atomically.
func (e *Engine) WriteFile(ctx context.Context, id, p string, data []byte, mode fs.FileMode) error {
	if len(data) > MaxFileSize {
		return errdefs.ResourceExhausted("file is larger than %d bytes", MaxFileSize)
	}
	if mode == 0 {
		mode = 0o644
	}
	r, rel, err := e.inRoot(ctx, id, p)
	if err != nil {
		return err
	}
	defer r.Close()
	if rel == "." {
		return errdefs.InvalidArgument("cannot write to the root directory")
	}
	if dir := path.Dir(rel); dir != "." {
		if err := r.MkdirAll(dir, 0o755); err != nil {
			return fileErr(p, err)
		}
	}
	// A symlink is written through, as a process in the sandbox would, if it stays inside
	// the root; the file it names is rewritten in place.
	if fi, err := r.Lstat(rel); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		if _, err := r.Stat(rel); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fileErr(p, err)
		}
		f, err := r.OpenFile(rel, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
		if err != nil {
			return fileErr(p, err)
		}
		_, werr := f.Write(data)
		if cerr := f.Close(); werr == nil {
			werr = cerr
		}
		return fileErr(p, werr)
	}
	tmp := path.Join(path.Dir(rel), ".cairn-write-"+newID("", 8))
	f, err := r.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return fileErr(p, err)
	}
	_, werr := f.Write(data)
	if cerr := f.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = r.Rename(tmp, rel)
	}
	if werr != nil {
		r.Remove(tmp)
	}
	return fileErr(p, werr)
}

func fileInfo(p string, fi fs.FileInfo, link string) *model.FileInfo {
	return &model.FileInfo{Name: fi.Name(), Path: p, Size: fi.Size(), Mode: fi.Mode().String(),
		IsDir: fi.IsDir(), Link: link, ModTime: fi.ModTime().UTC()}
}

// Stat describes a path of a sandbox (a symlink itself, not its target).
func (e *Engine) Stat(ctx context.Context, id, p string) (*model.FileInfo, error) {
	r, rel, err := e.inRoot(ctx, id, p)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	fi, err := r.Lstat(rel)
	if err != nil {
		return nil, fileErr(p, err)
	}
	link := ""
	if fi.Mode()&fs.ModeSymlink != 0 {
		link, _ = r.Readlink(rel)
	}
	return fileInfo(path.Clean("/"+p), fi, link), nil
}

// ListDir lists a directory of a sandbox.
func (e *Engine) ListDir(ctx context.Context, id, p string) ([]*model.FileInfo, error) {
	r, rel, err := e.inRoot(ctx, id, p)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	f, err := r.Open(rel)
	if err != nil {
		return nil, fileErr(p, err)
	}
	defer f.Close()
	entries, err := f.ReadDir(-1)
	if err != nil {
		return nil, fileErr(p, err)
	}
	out := make([]*model.FileInfo, 0, len(entries))
	for _, d := range entries {
		fi, err := d.Info()
		if err != nil {
			continue
		}
		child := path.Join("/", rel, d.Name())
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			link, _ = r.Readlink(path.Join(rel, d.Name()))
		}
		out = append(out, fileInfo(child, fi, link))
	}
	return out, nil
}

// RemovePath removes a file or (recursively) a directory of a sandbox.
func (e *Engine) RemovePath(ctx context.Context, id, p string) error {
	r, rel, err := e.inRoot(ctx, id, p)
	if err != nil {
		return err
	}
	defer r.Close()
	if rel == "." {
		return errdefs.InvalidArgument("refusing to remove the sandbox's root directory")
	}
	if _, err := r.Lstat(rel); err != nil {
		return fileErr(p, err)
	}
	return fileErr(p, r.RemoveAll(rel))
}

// Diff lists the paths that differ between two checkpoints' filesystems: added,
// changed (type, mode, owner, size, content or link target) and deleted. The control
// directory /.cairn is left out.
func (e *Engine) Diff(ctx context.Context, from, to string) ([]model.Change, error) {
	a, err := e.checkpoint(ctx, from)
	if err != nil {
		return nil, err
	}
	b, err := e.checkpoint(ctx, to)
	if err != nil {
		return nil, err
	}
	return diffTrees(ctx, e.pool.Path(a.FSVolume), e.pool.Path(b.FSVolume))
}
