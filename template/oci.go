package template

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"golang.org/x/sys/unix"

	"github.com/cairn-sandbox/cairn/errdefs"
)

// importOCI applies the layers of the image at src (OCI layout directory or
// `docker save` tarball) onto dst.
func importOCI(ctx context.Context, src, dst string, progress Progress) (string, error) {
	progress.Stage("reading image")
	img, kind, err := openImage(src)
	if err != nil {
		return "", err
	}
	digest, err := img.Digest()
	if err != nil {
		return "", errdefs.InvalidArgument("OCI image %s is unreadable: %w", src, err)
	}
	layers, err := img.Layers()
	if err != nil {
		return "", errdefs.InvalidArgument("OCI image %s: cannot list layers: %w", src, err)
	}
	rootfd, err := unix.Open(dst, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", errdefs.FailedPrecondition("open template target %s: %w", dst, err)
	}
	defer unix.Close(rootfd)
	a := &layerApplier{root: rootfd, progress: progress, dirTimes: map[string]unix.Timespec{}}
	for i, l := range layers {
		progress.Stage(fmt.Sprintf("layer %d/%d", i+1, len(layers)))
		progress.Advance(int64(i), int64(len(layers)))
		if err := a.applyLayer(ctx, l); err != nil {
			if ctx.Err() != nil {
				return "", fmt.Errorf("import of %s interrupted: %w", src, ctx.Err())
			}
			if isClassified(err) {
				return "", fmt.Errorf("OCI image %s, layer %d: %w", src, i+1, err)
			}
			return "", errdefs.FailedPrecondition("OCI image %s, layer %d: %w", src, i+1, err)
		}
	}
	if err := a.applyDirTimes(); err != nil {
		return "", errdefs.FailedPrecondition("OCI image %s: %w", src, err)
	}
	progress.Advance(int64(len(layers)), int64(len(layers)))
	return fmt.Sprintf("%s %s (%s, %d layers)", kind, src, digest, len(layers)), nil
}

// openImage opens an OCI layout directory or a `docker save` tarball.
func openImage(src string) (v1.Image, string, error) {
	st, err := os.Stat(src)
	if os.IsNotExist(err) {
		return nil, "", errdefs.NotFound("OCI image %s does not exist", src)
	}
	if err != nil {
		return nil, "", errdefs.FailedPrecondition("OCI image %s: %w", src, err)
	}
	if !st.IsDir() {
		img, err := tarball.ImageFromPath(src, nil)
		if err != nil {
			return nil, "", errdefs.InvalidArgument("%s is not a readable `docker save` tarball "+
				"holding exactly one image (%v): save a single image, or pass an OCI layout directory", src, err)
		}
		return img, "docker archive", nil
	}
	idx, err := layout.ImageIndexFromPath(src)
	if err != nil {
		return nil, "", errdefs.InvalidArgument("%s is not an OCI image layout (%v): "+
			"it needs oci-layout and index.json", src, err)
	}
	img, err := pickImage(idx, 0)
	if err != nil {
		return nil, "", fmt.Errorf("OCI layout %s: %w", src, err)
	}
	return img, "OCI layout", nil
}

// pickImage returns the first image of the index built for this machine (linux and
// runtime.GOARCH, or no platform stated), descending into nested indexes.
func pickImage(idx v1.ImageIndex, depth int) (v1.Image, error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, errdefs.InvalidArgument("unreadable index: %w", err)
	}
	var seen []string
	for _, d := range im.Manifests {
		if p := d.Platform; p != nil {
			seen = append(seen, p.OS+"/"+p.Architecture)
			if p.OS != "linux" || p.Architecture != runtime.GOARCH {
				continue
			}
		}
		switch d.MediaType {
		case types.OCIManifestSchema1, types.DockerManifestSchema2:
			return idx.Image(d.Digest)
		case types.OCIImageIndex, types.DockerManifestList:
			if depth > 4 {
				continue
			}
			child, err := idx.ImageIndex(d.Digest)
			if err != nil {
				return nil, errdefs.InvalidArgument("unreadable nested index %s: %w", d.Digest, err)
			}
			if img, err := pickImage(child, depth+1); err == nil {
				return img, nil
			}
		}
	}
	return nil, errdefs.NotFound("no linux/%s image in the index (platforms: %s): "+
		"export the image for this machine's architecture", runtime.GOARCH, strings.Join(seen, ", "))
}

// layerApplier unpacks layer tars into a root directory. Every path is resolved with
// openat2(RESOLVE_IN_ROOT) from the root's fd, so ".." and symlinks (absolute or
// relative, planted by an earlier entry or layer) resolve inside the root, the way they
// will inside the sandbox, and never reach the host; the final component is created with
// *at calls that do not follow symlinks.
type layerApplier struct {
	root     int
	progress Progress
	written  map[string]bool // paths created by the current layer (for opaque dirs)
	dirTimes map[string]unix.Timespec
}

func (a *layerApplier) applyLayer(ctx context.Context, l v1.Layer) error {
	rc, err := l.Uncompressed()
	if err != nil {
		return errdefs.InvalidArgument("cannot open layer: %w", err)
	}
	defer rc.Close()
	a.written = map[string]bool{}
	tr := tar.NewReader(rc)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return errdefs.InvalidArgument("corrupt layer: %w", err)
		}
		if err := a.applyEntry(hdr, tr); err != nil {
			return err
		}
	}
}

// cleanName turns a tar entry name into a root-relative path ("" for the root itself),
// rejecting ".." components outright: no legitimate layer needs them.
func cleanName(name string) (string, error) {
	var parts []string
	for _, p := range strings.Split(name, "/") {
		switch p {
		case "", ".":
		case "..":
			return "", errdefs.InvalidArgument("layer entry %q contains \"..\": the image is "+
				"malformed or malicious; rebuild it", name)
		default:
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "/"), nil
}

func (a *layerApplier) applyEntry(hdr *tar.Header, r io.Reader) error {
	rel, err := cleanName(hdr.Name)
	if err != nil || rel == "" { // the root keeps the caller's owner and mode
		return err
	}
	dir, base := path.Dir(rel), path.Base(rel)
	if base == ".wh..wh..opq" {
		return a.opaque(dir)
	}
	if strings.HasPrefix(base, ".wh..wh.") {
		return nil // other aufs metadata (.wh..wh.plnk...): not part of the tree
	}
	if victim, ok := strings.CutPrefix(base, ".wh."); ok {
		if victim == "" || victim == "." || victim == ".." {
			return errdefs.InvalidArgument("layer entry %q is not a valid whiteout; fix the image", hdr.Name)
		}
		if a.written[path.Join(dir, victim)] {
			return nil // whiteout of this layer's own entry: nothing from below to hide
		}
		pfd, err := a.openDir(dir, false)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			return nil // whiting out something absent
		}
		if err != nil {
			return err
		}
		defer unix.Close(pfd)
		return removeAt(pfd, victim)
	}
	pfd, err := a.openDir(dir, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	if err := a.clearFor(pfd, base, hdr.Typeflag == tar.TypeDir); err != nil {
		return fmt.Errorf("replace %s: %w", rel, err)
	}
	if err := a.create(pfd, base, rel, hdr, r); err != nil {
		return fmt.Errorf("create %s: %w", rel, err)
	}
	a.written[rel] = true
	return nil
}

// clearFor removes whatever a lower layer left at name, unless both are directories
// (directories merge).
func (a *layerApplier) clearFor(pfd int, name string, isDir bool) error {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return err
	}
	if isDir && st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return nil
	}
	return removeAt(pfd, name)
}

func (a *layerApplier) create(pfd int, base, rel string, hdr *tar.Header, r io.Reader) error {
	mode := uint32(hdr.Mode) & 0o7777
	uid, gid := hdr.Uid, hdr.Gid
	times := []unix.Timespec{unix.NsecToTimespec(hdr.AccessTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	if hdr.AccessTime.IsZero() {
		times[0] = times[1]
	}
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return err
		}
		fd, err := unix.Openat(pfd, base, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		a.dirTimes[rel] = times[1] // set last: later entries change a directory's mtime
		return a.setFdMeta(fd, rel, uid, gid, mode, hdr)
	case tar.TypeReg, tar.TypeRegA:
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return err
		}
		f := os.NewFile(uintptr(fd), rel)
		defer f.Close()
		if _, err := io.Copy(f, r); err != nil {
			return err
		}
		if err := a.setFdMeta(fd, rel, uid, gid, mode, hdr); err != nil {
			return err
		}
		return unix.UtimesNanoAt(pfd, base, times, unix.AT_SYMLINK_NOFOLLOW)
	case tar.TypeSymlink:
		if err := unix.Symlinkat(hdr.Linkname, pfd, base); err != nil {
			return err
		}
	case tar.TypeLink:
		return a.hardlink(pfd, base, hdr.Linkname)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknodat(pfd, base, kind|mode, int(dev)); err != nil {
			return err
		}
		if err := unix.Fchownat(pfd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
		// Follows a final symlink, but base is the node created just above.
		if err := unix.Fchmodat(pfd, base, mode, 0); err != nil {
			return err
		}
		return unix.UtimesNanoAt(pfd, base, times, unix.AT_SYMLINK_NOFOLLOW)
	default:
		a.progress.Log(fmt.Sprintf("skipping %s: unsupported tar entry type %q", rel, hdr.Typeflag))
		return nil
	}
	// Symlink.
	if err := unix.Fchownat(pfd, base, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	return unix.UtimesNanoAt(pfd, base, times, unix.AT_SYMLINK_NOFOLLOW)
}

// setFdMeta sets owner, then mode (chown clears setuid bits), then the PAX xattrs.
func (a *layerApplier) setFdMeta(fd int, rel string, uid, gid int, mode uint32, hdr *tar.Header) error {
	if err := unix.Fchown(fd, uid, gid); err != nil {
		if errors.Is(err, unix.EPERM) {
			return errdefs.PermissionDenied("cannot give %s owner %d:%d: run as root to import images", rel, uid, gid)
		}
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	for k, v := range hdr.PAXRecords {
		if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
			if err := unix.Fsetxattr(fd, name, []byte(v), 0); err != nil {
				a.progress.Log(fmt.Sprintf("xattr %s of %s not set: %v", name, rel, err))
			}
		}
	}
	return nil
}

// hardlink links base to an earlier entry; the target name resolves inside the root too.
func (a *layerApplier) hardlink(pfd int, base, linkname string) error {
	trel, err := cleanName(linkname)
	if err != nil {
		return err
	}
	if trel == "" {
		return errdefs.InvalidArgument("hardlink to the image root is not allowed")
	}
	tfd, err := a.openDir(path.Dir(trel), false)
	if err == nil {
		defer unix.Close(tfd)
		// Flags 0: a symlink target is not followed; the link names the symlink itself.
		err = unix.Linkat(tfd, path.Base(trel), pfd, base, 0)
	}
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return errdefs.InvalidArgument("hardlink target %q is not in the image (links may only "+
			"point to earlier entries); fix the image", linkname)
	}
	return err
}

// openDir opens directory rel inside the root, creating missing components (0755,
// root-owned: implicit parents) when create is set.
func (a *layerApplier) openDir(rel string, create bool) (int, error) {
	if rel == "" || rel == "." {
		rel = "."
	}
	how := &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	}
	for attempt := 0; ; attempt++ {
		fd, err := unix.Openat2(a.root, rel, how)
		if errors.Is(err, unix.EAGAIN) && attempt < 8 { // concurrent rename; retry
			continue
		}
		if err == nil || !create || rel == "." || !errors.Is(err, unix.ENOENT) {
			if err != nil {
				err = fmt.Errorf("open directory /%s in the image: %w", rel, err)
			}
			return fd, err
		}
		if attempt > 0 { // created it, still absent: a component is a dangling symlink
			return -1, errdefs.InvalidArgument("layer entry below /%s: a component of that path is "+
				"a symlink to a directory missing from the image; fix the image", rel)
		}
		pfd, err := a.openDir(path.Dir(rel), true)
		if err != nil {
			return -1, err
		}
		err = unix.Mkdirat(pfd, path.Base(rel), 0o755)
		unix.Close(pfd)
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return -1, fmt.Errorf("create directory /%s in the image: %w", rel, err)
		}
	}
}

// opaque empties directory rel of everything lower layers put there, keeping what the
// current layer wrote (a layer may list the opaque marker after its own entries).
func (a *layerApplier) opaque(rel string) error {
	fd, err := a.openDir(rel, true)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return a.removeLower(fd, rel)
}

func (a *layerApplier) removeLower(fd int, rel string) error {
	names, err := readDirNames(fd)
	if err != nil {
		return err
	}
	for _, n := range names {
		child := path.Join(rel, n)
		if !a.written[child] {
			if err := removeAt(fd, n); err != nil {
				return err
			}
			continue
		}
		cfd, err := unix.Openat(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
			continue // this layer's own file or symlink
		}
		if err != nil {
			return err
		}
		err = a.removeLower(cfd, child)
		unix.Close(cfd)
		if err != nil {
			return err
		}
	}
	return nil
}

// removeAt removes name (recursively for directories) relative to dirfd without
// following symlinks.
func removeAt(dirfd int, name string) error {
	err := unix.Unlinkat(dirfd, name, 0)
	if err == nil || errors.Is(err, unix.ENOENT) {
		return nil
	}
	if !errors.Is(err, unix.EISDIR) {
		return err
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	names, err := readDirNames(fd)
	for _, n := range names {
		if err == nil {
			err = removeAt(fd, n)
		}
	}
	unix.Close(fd)
	if err != nil {
		return err
	}
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

// readDirNames lists a directory fd without consuming it (it reads through a dup).
func readDirNames(fd int) ([]string, error) {
	dup, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dup), ".")
	defer f.Close()
	return f.Readdirnames(-1)
}

// applyDirTimes sets directory mtimes once all layers are in, deepest first.
func (a *layerApplier) applyDirTimes() error {
	dirs := make([]string, 0, len(a.dirTimes))
	for d := range a.dirTimes {
		dirs = append(dirs, d)
	}
	sort.Slice(dirs, func(i, j int) bool { return strings.Count(dirs[i], "/") > strings.Count(dirs[j], "/") })
	for _, d := range dirs {
		pfd, err := a.openDir(path.Dir(d), false)
		if err != nil {
			continue // removed by a later layer
		}
		var st unix.Stat_t
		if err := unix.Fstatat(pfd, path.Base(d), &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			unix.Close(pfd)
			continue // replaced by a non-directory in a later layer
		}
		ts := a.dirTimes[d]
		err = unix.UtimesNanoAt(pfd, path.Base(d), []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW)
		unix.Close(pfd)
		if err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("set time of /%s: %w", d, err)
		}
	}
	return nil
}
