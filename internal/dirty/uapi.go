package dirty

import "unsafe"

// The kernel interfaces used here, which x/sys/unix does not define (and Debian 12's
// headers predate), written out from their uapi headers.

// From include/uapi/linux/userfaultfd.h.
const (
	uffdAPI = 0xaa

	// uffdUserModeOnly is the userfaultfd(2) flag that lets a process without
	// CAP_SYS_PTRACE create one whatever vm.unprivileged_userfaultfd says (it handles
	// faults of user mode only, which asynchronous write-protect never delivers anyway).
	uffdUserModeOnly = 1

	uffdFeatureWPUnpopulated = 1 << 13
	uffdFeatureWPAsync       = 1 << 15

	uffdioRegisterModeWP     = 1 << 1
	uffdioWriteprotectModeWP = 1 << 0

	// uffdioWriteprotectBit is _UFFDIO_WRITEPROTECT, the bit of the ioctls a register
	// reports as usable on its range.
	uffdioWriteprotectBit = 0x06
)

type uffdioAPIArg struct {
	API      uint64
	Features uint64
	Ioctls   uint64
}

type uffdioRange struct {
	Start uint64
	Len   uint64
}

type uffdioRegisterArg struct {
	Range  uffdioRange
	Mode   uint64
	Ioctls uint64
}

type uffdioWriteprotectArg struct {
	Range uffdioRange
	Mode  uint64
}

// ioctl request numbers, _IOWR(type, nr, size) of include/uapi/asm-generic/ioctl.h.
const (
	iocReadWrite = 3 << 30

	uffdioAPI          = iocReadWrite | unsafe.Sizeof(uffdioAPIArg{})<<16 | uffdAPI<<8 | 0x3f
	uffdioRegister     = iocReadWrite | unsafe.Sizeof(uffdioRegisterArg{})<<16 | uffdAPI<<8 | 0x00
	uffdioWriteprotect = iocReadWrite | unsafe.Sizeof(uffdioWriteprotectArg{})<<16 | uffdAPI<<8 | 0x06

	// pagemapScan is PAGEMAP_SCAN of include/uapi/linux/fs.h, an ioctl of
	// /proc/<pid>/pagemap (PROCFS_IOCTL_MAGIC 'f', 16).
	pagemapScan = iocReadWrite | unsafe.Sizeof(pmScanArg{})<<16 | 'f'<<8 | 16
)

// From include/uapi/linux/fs.h: the PAGE_IS_* categories of PAGEMAP_SCAN and its flags.
const (
	pageIsWPAllowed = 1 << 0
	pageIsWritten   = 1 << 1
	pageIsFile      = 1 << 2
	pageIsPresent   = 1 << 3
	pageIsSwapped   = 1 << 4
	pageIsPFNZero   = 1 << 5
	pageIsHuge      = 1 << 6

	pmScanWPMatching   = 1 << 0
	pmScanCheckWPAsync = 1 << 1
)

// pmScanArg is struct pm_scan_arg. A page matches when, with the categories of
// CategoryInverted flipped, it has all of CategoryMask and (if not 0) one of
// CategoryAnyofMask; the kernel writes WalkEnd, where it stopped.
type pmScanArg struct {
	Size              uint64
	Flags             uint64
	Start             uint64
	End               uint64
	WalkEnd           uint64
	Vec               uint64
	VecLen            uint64
	MaxPages          uint64
	CategoryInverted  uint64
	CategoryMask      uint64
	CategoryAnyofMask uint64
	ReturnMask        uint64
}

// pageRegion is struct page_region: [Start, End) with the categories (of the
// ReturnMask) its pages share.
type pageRegion struct {
	Start      uint64
	End        uint64
	Categories uint64
}
