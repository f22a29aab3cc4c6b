package btrfs

import (
	"bytes"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The btrfs ioctl ABI (include/uapi/linux/btrfs.h). It is defined here rather than taken
// from a library because x/sys/unix does not carry it and the hot path must not fork the
// btrfs binary. Every argument struct is exactly 4096 bytes, which is part of the request
// number, so the size assertions below catch a layout mistake at compile time.
const (
	btrfsIoctlMagic = 0x94

	btrfsPathNameMax   = 4087 // BTRFS_PATH_NAME_MAX
	btrfsSubvolNameMax = 4039 // BTRFS_SUBVOL_NAME_MAX
	btrfsVolNameMax    = 255  // BTRFS_VOL_NAME_MAX
	btrfsMaxRootrefs   = 255  // BTRFS_MAX_ROOTREF_BUFFER_NUM
	btrfsInoLookupPath = 4080 - btrfsVolNameMax - 1

	btrfsSubvolRdonly = 1 << 1 // BTRFS_SUBVOL_RDONLY

	// btrfsFirstFreeObjectID is the inode number of every subvolume's root directory;
	// no other inode in a subvolume has it, so it identifies a volume with one stat.
	btrfsFirstFreeObjectID = 256
)

// volArgs is struct btrfs_ioctl_vol_args.
type volArgs struct {
	fd   int64
	name [btrfsPathNameMax + 1]byte
}

// volArgsV2 is struct btrfs_ioctl_vol_args_v2 (the unions flattened to their largest
// member: unused[4] and name).
type volArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [btrfsSubvolNameMax + 1]byte
}

// rootrefArgs is struct btrfs_ioctl_get_subvol_rootref_args.
type rootrefArgs struct {
	minTreeID uint64
	rootref   [btrfsMaxRootrefs]struct{ treeID, dirID uint64 }
	numItems  uint8
	_         [7]uint8
}

// inoLookupUserArgs is struct btrfs_ioctl_ino_lookup_user_args.
type inoLookupUserArgs struct {
	dirID  uint64
	treeID uint64
	name   [btrfsVolNameMax + 1]byte
	path   [btrfsInoLookupPath]byte
}

// Compile-time size checks: each line fails to build if the struct is not 4096 bytes.
var (
	_ [unsafe.Sizeof(volArgs{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(volArgs{})]struct{}
	_ [unsafe.Sizeof(volArgsV2{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(volArgsV2{})]struct{}
	_ [unsafe.Sizeof(rootrefArgs{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(rootrefArgs{})]struct{}
	_ [unsafe.Sizeof(inoLookupUserArgs{}) - 4096]struct{}
	_ [4096 - unsafe.Sizeof(inoLookupUserArgs{})]struct{}
)

// Linux _IOC encoding (asm-generic: dir in bits 30-31, size in 16-29, type 8-15, nr 0-7).
func ioc(dir, nr, size uintptr) uintptr {
	return dir<<30 | size<<16 | btrfsIoctlMagic<<8 | nr
}

const (
	iocWrite = 1
	iocRead  = 2
)

var (
	iocSubvolCreate     = ioc(iocWrite, 14, unsafe.Sizeof(volArgs{}))                   // BTRFS_IOC_SUBVOL_CREATE
	iocSnapDestroy      = ioc(iocWrite, 15, unsafe.Sizeof(volArgs{}))                   // BTRFS_IOC_SNAP_DESTROY
	iocSnapCreateV2     = ioc(iocWrite, 23, unsafe.Sizeof(volArgsV2{}))                 // BTRFS_IOC_SNAP_CREATE_V2
	iocSubvolGetflags   = ioc(iocRead, 25, 8)                                           // BTRFS_IOC_SUBVOL_GETFLAGS
	iocSubvolSetflags   = ioc(iocWrite, 26, 8)                                          // BTRFS_IOC_SUBVOL_SETFLAGS
	iocGetSubvolRootref = ioc(iocRead|iocWrite, 61, unsafe.Sizeof(rootrefArgs{}))       // BTRFS_IOC_GET_SUBVOL_ROOTREF
	iocInoLookupUser    = ioc(iocRead|iocWrite, 62, unsafe.Sizeof(inoLookupUserArgs{})) // BTRFS_IOC_INO_LOOKUP_USER
)

// fstrimRange is struct fstrim_range (include/uapi/linux/fs.h), FITRIM's argument.
type fstrimRange struct{ start, len, minlen uint64 }

// iocFitrim is FITRIM, _IOWR('X', 121, struct fstrim_range): not a btrfs ioctl.
var iocFitrim = (iocRead|iocWrite)<<30 | unsafe.Sizeof(fstrimRange{})<<16 | 'X'<<8 | 121

func ioctl(fd int, req uintptr, arg unsafe.Pointer) error {
	for {
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
		switch errno {
		case 0:
			return nil
		case unix.EINTR:
			continue
		}
		return errno
	}
}

// subvolCreate creates an empty subvolume name in the directory dirfd.
func subvolCreate(dirfd int, name string) error {
	var a volArgs
	copy(a.name[:], name)
	return ioctl(dirfd, iocSubvolCreate, unsafe.Pointer(&a))
}

// snapCreate snapshots the subvolume srcfd as name in the directory dirfd. The kernel
// commits a transaction before returning, so the snapshot itself is durable.
func snapCreate(dirfd, srcfd int, name string, readonly bool) error {
	a := volArgsV2{fd: int64(srcfd)}
	if readonly {
		a.flags = btrfsSubvolRdonly
	}
	copy(a.name[:], name)
	return ioctl(dirfd, iocSnapCreateV2, unsafe.Pointer(&a))
}

// snapDestroy unlinks the subvolume name from the directory dirfd; the kernel's cleaner
// thread frees its extents later. It fails with ENOTEMPTY while subvolumes are nested in it.
func snapDestroy(dirfd int, name string) error {
	var a volArgs
	copy(a.name[:], name)
	return ioctl(dirfd, iocSnapDestroy, unsafe.Pointer(&a))
}

func getFlags(fd int) (uint64, error) {
	var f uint64
	err := ioctl(fd, iocSubvolGetflags, unsafe.Pointer(&f))
	return f, err
}

func setFlags(fd int, f uint64) error {
	return ioctl(fd, iocSubvolSetflags, unsafe.Pointer(&f))
}

// nestedSubvols returns the paths, relative to the directory volfd, of the subvolumes
// directly nested in volfd's subvolume below volfd (at any directory depth, but not
// their own children).
// It costs two ioctls per child instead of a walk over every file of the volume.
func nestedSubvols(volfd int) ([]string, error) {
	var refs []struct{ treeID, dirID uint64 }
	var a rootrefArgs
	for {
		err := ioctl(volfd, iocGetSubvolRootref, unsafe.Pointer(&a))
		if err != nil && err != unix.EOVERFLOW {
			return nil, err
		}
		refs = append(refs, a.rootref[:a.numItems]...)
		if err == nil {
			break
		}
		// EOVERFLOW: the buffer filled up; the kernel advanced minTreeID for the next call.
	}
	paths := make([]string, 0, len(refs))
	for _, r := range refs {
		l := inoLookupUserArgs{dirID: r.dirID, treeID: r.treeID}
		if err := ioctl(volfd, iocInoLookupUser, unsafe.Pointer(&l)); err != nil {
			if err == unix.ENOENT || err == unix.EACCES {
				// ENOENT: deleted since GET_SUBVOL_ROOTREF. EACCES: not below volfd, which
				// happens when volfd is a plain directory rather than a subvolume root.
				continue
			}
			return nil, err
		}
		// path is the directory chain from volfd to the child's parent, each element
		// followed by "/", or empty; name is the child's own entry.
		paths = append(paths, cstr(l.path[:])+cstr(l.name[:]))
	}
	return paths, nil
}

func cstr(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// subvolInfoArgs is struct btrfs_ioctl_get_subvol_info_args.
type subvolInfoArgs struct {
	treeID                                 uint64
	name                                   [btrfsVolNameMax + 1]byte
	parentID, dirID, generation, flags     uint64
	uuid, parentUUID, receivedUUID         [16]byte
	ctransid, otransid, stransid, rtransid uint64
	ctime, otime, stime, rtime             struct {
		sec  uint64
		nsec uint32
		_    uint32
	}
	_ [8]uint64
}

var (
	_ [unsafe.Sizeof(subvolInfoArgs{}) - 504]struct{}
	_ [504 - unsafe.Sizeof(subvolInfoArgs{})]struct{}
)

// rootSubvolRdonly is BTRFS_ROOT_SUBVOL_RDONLY, the read-only bit of a root item's
// flags (subvolInfoArgs.flags), not the ioctls' btrfsSubvolRdonly.
const rootSubvolRdonly = 1

var iocGetSubvolInfo = ioc(iocRead, 60, unsafe.Sizeof(subvolInfoArgs{})) // BTRFS_IOC_GET_SUBVOL_INFO

// subvolInfo returns what the kernel knows of the subvolume fd is in. The kernel reads
// the root item it holds in memory, so ctransid counts changes not yet committed.
func subvolInfo(fd int) (*subvolInfoArgs, error) {
	var a subvolInfoArgs
	if err := ioctl(fd, iocGetSubvolInfo, unsafe.Pointer(&a)); err != nil {
		return nil, err
	}
	return &a, nil
}

// fsInfoArgs is struct btrfs_ioctl_fs_info_args.
type fsInfoArgs struct {
	maxID, numDevices                uint64
	fsid                             [16]byte
	nodesize, sectorsize, cloneAlign uint32
	csumType, csumSize               uint16
	flags, generation                uint64
	metadataUUID                     [16]byte
	_                                [944]byte
}

var (
	_ [unsafe.Sizeof(fsInfoArgs{}) - 1024]struct{}
	_ [1024 - unsafe.Sizeof(fsInfoArgs{})]struct{}
)

var iocFsInfo = ioc(iocRead, 31, unsafe.Sizeof(fsInfoArgs{})) // BTRFS_IOC_FS_INFO

func fsInfo(fd int) (*fsInfoArgs, error) {
	var a fsInfoArgs
	if err := ioctl(fd, iocFsInfo, unsafe.Pointer(&a)); err != nil {
		return nil, err
	}
	return &a, nil
}
