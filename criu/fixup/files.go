package fixup

import (
	"encoding/base64"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/checkpoint-restore/go-criu/v8/crit"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fs"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/mm"
	pipe_data "github.com/checkpoint-restore/go-criu/v8/crit/images/pipe-data"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/regfile"
	remap_file_path "github.com/checkpoint-restore/go-criu/v8/crit/images/remap-file-path"
	"golang.org/x/sys/unix"
)

// VMA status bits of vma_entry.status (criu/include/image.h).
const (
	vmaFilePrivate = 1 << 6
	vmaFileShared  = 1 << 7
	vmaMemfd       = 1 << 14
)

// remapGhostBit marks a ghost remap in images older than remap_type.
const remapGhostBit = 0x80000000

// deletedSuffix ends the /proc path of an unlinked file.
const deletedSuffix = " (deleted)"

// defaultPipeSize is a pipe's capacity unless F_SETPIPE_SZ changed it.
const defaultPipeSize = 16 * 4096

func (d *dump) fileByID(id uint32) *fdinfo.FileEntry {
	for _, e := range d.files.entries {
		if f := e.Message.(*fdinfo.FileEntry); f.GetId() == id {
			return f
		}
	}
	return nil
}

func (d *dump) fdIndex() map[int]*fdinfo.FdinfoEntry {
	m := map[int]*fdinfo.FdinfoEntry{}
	for _, e := range d.fdinfo.entries {
		fe := e.Message.(*fdinfo.FdinfoEntry)
		m[int(fe.GetFd())] = fe
	}
	return m
}

// fdList names the dump's descriptors, for errors.
func (d *dump) fdList() string {
	var fds []int
	for fd := range d.fdIndex() {
		fds = append(fds, fd)
	}
	sort.Ints(fds)
	return fmt.Sprintf("its descriptors are %v", fds)
}

// pathEntry returns the entry holding f's path, flags and offset: f's own for a
// regular file (directories and devices too), the one of its path for a FIFO.
func (d *dump) pathEntry(f *fdinfo.FileEntry) *regfile.RegFileEntry {
	switch f.GetType() {
	case fdinfo.FdTypes_REG:
		return f.GetReg()
	case fdinfo.FdTypes_FIFO:
		if r := d.fileByID(f.GetFifo().GetRegfId()); r.GetType() == fdinfo.FdTypes_REG {
			return r.GetReg()
		}
	}
	return nil
}

// claim is a reference to a regular-file entry that the Spec gives a path.
type claim struct {
	id   uint32
	path string
	who  string
	// repoint makes the reference use another entry (nil for a descriptor, whose entry
	// is its open file description and cannot be split).
	repoint func(uint32)
}

// livePath returns the path to give an entry, and false for a path that was already
// unlinked at the checkpoint (its ghost stays).
func livePath(p string) (string, bool) {
	return p, p != "" && !strings.HasSuffix(p, deletedSuffix)
}

// fixFiles applies s's descriptors, cwd, executable and mappings to the file entries,
// then drops the remaps of every entry it named.
func (d *dump) fixFiles(s Spec) error {
	claims, err := d.fixDescriptors(s)
	if err != nil {
		return err
	}
	more, err := d.pathClaims(s)
	if err != nil {
		return err
	}
	claims = append(claims, more...)
	named := map[uint32]bool{}
	owner := map[uint32]claim{}
	for _, c := range claims {
		f := d.fileByID(c.id)
		if f.GetType() != fdinfo.FdTypes_REG && f.GetType() != fdinfo.FdTypes_FIFO {
			return unexpected(d.dir, "%s refers to file entry %d, a %s, not a file with a path", c.who, c.id, f.GetType())
		}
		if prev, ok := owner[c.id]; ok {
			if prev.path == c.path {
				continue
			}
			if c.repoint == nil || f.GetType() != fdinfo.FdTypes_REG {
				return invalid("%s and %s refer to one file entry in the dump, but Spec gives them paths %q and %q", prev.who, c.who, prev.path, c.path)
			}
			// Two references to one inode (a mapping and the executable, say) that the
			// Spec names differently: the later one gets an entry of its own.
			c.id = d.cloneReg(c.id, c.path)
			c.repoint(c.id)
			f = d.fileByID(c.id)
		}
		owner[c.id] = c
		r := d.pathEntry(f)
		if r == nil {
			return unexpected(d.dir, "%s: file entry %d has no path entry", c.who, c.id)
		}
		// The size, mode and build-ID CRIU validates the file against at restore were
		// read after the checkpoint, from the file the process went on using; the restore
		// opens the checkpoint's file at this path instead.
		name := c.path
		r.Name, r.Size, r.Mode, r.BuildId = &name, nil, nil, nil
		r.Checksum, r.ChecksumConfig, r.ChecksumParameter = nil, nil, nil
		named[r.GetId()] = true
	}
	d.files.changed = true
	d.dropRemaps(named)
	d.renameOwners()
	return nil
}

// fixDescriptors applies s.Files' flags and offsets and returns their path claims.
func (d *dump) fixDescriptors(s Spec) ([]claim, error) {
	fds := d.fdIndex()
	descs := map[uint32]File{}
	var claims []claim
	for _, f := range s.Files {
		fe, ok := fds[f.Fd]
		if !ok {
			return nil, invalid("Spec.Files: fd %d (%s) is not open in the dump (%s)", f.Fd, f.Path, d.fdList())
		}
		file := d.fileByID(fe.GetId())
		if file == nil {
			return nil, unexpected(d.dir, "fd %d refers to file entry %d, which files.img lacks", f.Fd, fe.GetId())
		}
		cloexec := uint32(0)
		if f.Flags&unix.O_CLOEXEC != 0 {
			cloexec = unix.FD_CLOEXEC
		}
		fe.Flags = &cloexec
		d.fdinfo.changed = true
		flags, pos := uint32(f.Flags&^unix.O_CLOEXEC), uint64(f.Pos)
		if prev, ok := descs[fe.GetId()]; ok {
			if prev.Path != f.Path || prev.Flags&^unix.O_CLOEXEC != f.Flags&^unix.O_CLOEXEC || prev.Pos != f.Pos {
				return nil, invalid("Spec.Files: fds %d and %d share one open file description in the dump, but Spec gives them different paths, flags or offsets (%+v, %+v)", prev.Fd, f.Fd, prev, f)
			}
			continue
		}
		descs[fe.GetId()] = f
		switch file.GetType() {
		case fdinfo.FdTypes_PIPE:
			ino, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(f.Path, "pipe:["), "]"), 10, 64)
			if err != nil || uint32(ino) != file.GetPipe().GetPipeId() {
				return nil, invalid("Spec.Files: fd %d is pipe:[%d] in the dump, Spec names it %s", f.Fd, file.GetPipe().GetPipeId(), f.Path)
			}
			file.GetPipe().Flags = &flags
		case fdinfo.FdTypes_REG, fdinfo.FdTypes_FIFO:
			r := d.pathEntry(file)
			if r == nil || !strings.HasPrefix(f.Path, "/") {
				return nil, invalid("Spec.Files: fd %d is a %s in the dump, Spec names it %s", f.Fd, file.GetType(), f.Path)
			}
			r.Flags, r.Pos = &flags, &pos
			if p, ok := livePath(f.Path); ok {
				claims = append(claims, claim{id: file.GetId(), path: p, who: fmt.Sprintf("fd %d", f.Fd)})
			}
		default:
			return nil, invalid("Spec.Files: fd %d is a %s in the dump: Apply rewrites files (regular, directories, devices, FIFOs) and pipes", f.Fd, file.GetType())
		}
	}
	return claims, nil
}

// pathClaims returns the path claims of s's cwd, executable and mappings.
func (d *dump) pathClaims(s Spec) ([]claim, error) {
	var claims []claim
	fse := d.fs.entries[0].Message.(*fs.FsEntry)
	if p, ok := livePath(s.Cwd); ok {
		claims = append(claims, claim{id: fse.GetCwdId(), path: p, who: "the cwd", repoint: func(id uint32) { fse.CwdId = &id }})
	}
	mme := d.mm.entries[0].Message.(*mm.MmEntry)
	if p, ok := livePath(s.Exe); ok {
		claims = append(claims, claim{id: mme.GetExeFileId(), path: p, who: "the executable", repoint: func(id uint32) { mme.ExeFileId = &id }})
	}
	for _, m := range s.Maps {
		var vma = -1
		for i, v := range mme.GetVmas() {
			if v.GetStart() <= m.Start && m.Start < v.GetEnd() {
				vma = i
				break
			}
		}
		if vma < 0 {
			return nil, invalid("Spec.Maps: nothing is mapped at %#x (%s) in the dump", m.Start, m.Path)
		}
		v := mme.GetVmas()[vma]
		if st := v.GetStatus(); st&(vmaFilePrivate|vmaFileShared) == 0 || st&vmaMemfd != 0 {
			return nil, invalid("Spec.Maps: the area at %#x-%#x holding %#x (%s) is not a file mapping in the dump (status %#x)", v.GetStart(), v.GetEnd(), m.Start, m.Path, st)
		}
		if p, ok := livePath(m.Path); ok {
			claims = append(claims, claim{id: uint32(v.GetShmid()), path: p, who: fmt.Sprintf("the mapping at %#x", v.GetStart()),
				repoint: func(id uint32) { v.Shmid = ptr(uint64(id)) }})
		}
	}
	return claims, nil
}

func ptr[T any](v T) *T { return &v }

// cloneReg returns the ID of a copy of regular-file entry id named path: one an
// earlier Apply of the directory added (so that running Apply again adds none), or a
// new one.
func (d *dump) cloneReg(id uint32, path string) uint32 {
	r := d.fileByID(id).GetReg()
	taken := map[uint32]bool{} // entries of descriptors, and remapped ones
	for _, e := range d.fdinfo.entries {
		taken[e.Message.(*fdinfo.FdinfoEntry).GetId()] = true
	}
	for _, e := range d.remaps.entries {
		taken[e.Message.(*remap_file_path.RemapFilePathEntry).GetOrigId()] = true
	}
	var top uint32
	for _, e := range d.files.entries {
		f := e.Message.(*fdinfo.FileEntry)
		c := f.GetReg()
		if c != nil && f.GetId() != id && !taken[f.GetId()] && c.GetName() == path && c.Size == nil && c.Mode == nil &&
			c.GetFlags() == r.GetFlags() && c.GetMntId() == r.GetMntId() {
			return f.GetId()
		}
		top = max(top, f.GetId())
	}
	nid := top + 1
	o := r.GetFown()
	ow := &fown.FownEntry{Uid: ptr(o.GetUid()), Euid: ptr(o.GetEuid()), Signum: ptr(o.GetSignum()), PidType: ptr(o.GetPidType()), Pid: ptr(o.GetPid())}
	c := &regfile.RegFileEntry{Id: ptr(nid), Flags: ptr(r.GetFlags()), Pos: ptr(r.GetPos()), Fown: ow, Name: ptr(r.GetName()), MntId: r.MntId, Ext: r.Ext}
	typ := fdinfo.FdTypes_REG
	d.files.entries = append(d.files.entries, &crit.CriuEntry{Message: &fdinfo.FileEntry{Type: &typ, Id: ptr(nid), Reg: c}})
	return nid
}

// remapKind returns a remap's type and the ID it remaps to (images older than
// remap_type mark ghosts with a bit of the ID).
func remapKind(r *remap_file_path.RemapFilePathEntry) (remap_file_path.RemapType, uint32) {
	if r.RemapType != nil {
		return r.GetRemapType(), r.GetRemapId()
	}
	if id := r.GetRemapId(); id&remapGhostBit != 0 {
		return remap_file_path.RemapType_GHOST, id &^ remapGhostBit
	}
	return remap_file_path.RemapType_LINKED, r.GetRemapId()
}

// dropRemaps removes the remaps of the named entries, and the link-remap entries
// nothing uses any more. Ghost images nothing uses go at the end of write.
func (d *dump) dropRemaps(named map[uint32]bool) {
	var keep []*crit.CriuEntry
	links := map[uint32]bool{}
	for _, e := range d.remaps.entries {
		r := e.Message.(*remap_file_path.RemapFilePathEntry)
		if !named[r.GetOrigId()] {
			keep = append(keep, e)
			continue
		}
		if k, id := remapKind(r); k == remap_file_path.RemapType_LINKED {
			links[id] = true
		}
		d.remaps.changed = true
	}
	d.remaps.entries = keep
	used := d.references()
	var files []*crit.CriuEntry
	for _, e := range d.files.entries {
		if id := e.Message.(*fdinfo.FileEntry).GetId(); links[id] && !used[id] {
			continue
		}
		files = append(files, e)
	}
	d.files.entries = files
}

// references returns the IDs of every file entry something refers to.
func (d *dump) references() map[uint32]bool {
	used := map[uint32]bool{}
	for _, e := range d.fdinfo.entries {
		used[e.Message.(*fdinfo.FdinfoEntry).GetId()] = true
	}
	for _, e := range d.files.entries {
		f := e.Message.(*fdinfo.FileEntry)
		if f.GetFifo() != nil {
			used[f.GetFifo().GetRegfId()] = true
		}
		if f.GetTty() != nil && f.GetTty().RegfId != nil {
			used[f.GetTty().GetRegfId()] = true
		}
	}
	fse := d.fs.entries[0].Message.(*fs.FsEntry)
	used[fse.GetCwdId()], used[fse.GetRootId()] = true, true
	mme := d.mm.entries[0].Message.(*mm.MmEntry)
	used[mme.GetExeFileId()] = true
	for _, v := range mme.GetVmas() {
		if v.GetStatus()&(vmaFilePrivate|vmaFileShared) != 0 {
			used[uint32(v.GetShmid())] = true
		}
	}
	for _, e := range d.remaps.entries {
		r := e.Message.(*remap_file_path.RemapFilePathEntry)
		used[r.GetOrigId()] = true
		if k, id := remapKind(r); k == remap_file_path.RemapType_LINKED {
			used[id] = true
		}
	}
	return used
}

// unusedGhosts returns the ghost images no remap refers to.
func (d *dump) unusedGhosts() []string {
	used := map[uint64]bool{}
	for _, e := range d.remaps.entries {
		if k, id := remapKind(e.Message.(*remap_file_path.RemapFilePathEntry)); k == remap_file_path.RemapType_GHOST {
			used[uint64(id)] = true
		}
	}
	var out []string
	for _, name := range d.ghosts {
		id, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimPrefix(name, "ghost-file-"), ".img"), 16, 32)
		if err == nil && !used[id] {
			out = append(out, name)
		}
	}
	return out
}

// owned is a file entry with an owner (F_SETOWN): every kind has a fown field.
type owned interface{ GetFown() *fown.FownEntry }

// renameOwners makes file owners and pidfds that name the task's old PID name the new
// one.
func (d *dump) renameOwners() {
	for _, e := range d.files.entries {
		f := e.Message.(*fdinfo.FileEntry)
		for _, sub := range []any{f.Reg, f.Isk, f.Psk, f.Nlsk, f.Efd, f.Epfd, f.Sgfd, f.Tunf, f.Tfd,
			f.Ify, f.Ffy, f.Usk, f.Pipe, f.Tty, f.Memfd, f.Bpf, f.Pidfd} {
			if o, ok := sub.(owned); ok {
				if ow := o.GetFown(); ow != nil && ow.GetPid() == d.pid {
					ow.Pid = ptr(d.newPid)
				}
			}
		}
		if p := f.GetPidfd(); p != nil && uint32(p.GetNspid()) == d.pid {
			p.Nspid = ptr(int32(d.newPid))
		}
	}
}

// fixPipes makes the pipes' and FIFOs' data images hold s.Pipes' bytes.
func (d *dump) fixPipes(s Spec) error {
	where := map[uint32]*image{}
	for _, e := range d.files.entries {
		f := e.Message.(*fdinfo.FileEntry)
		switch {
		case f.GetPipe() != nil:
			where[f.GetPipe().GetPipeId()] = d.pipes
		case f.GetFifo() != nil:
			where[f.GetFifo().GetPipeId()] = d.fifos
		}
	}
	for _, p := range s.Pipes {
		id := uint32(p.Ino)
		im := where[id]
		if im == nil {
			var inos []uint32
			for ino := range where {
				inos = append(inos, ino)
			}
			sort.Slice(inos, func(i, j int) bool { return inos[i] < inos[j] })
			return invalid("Spec.Pipes: no pipe or FIFO of inode %d is open in the dump (its pipes and FIFOs: %v)", p.Ino, inos)
		}
		setPipeData(im, id, p.Data)
	}
	return nil
}

// setPipeData makes im's data for pipe id exactly data. CRIU writes an entry (with the
// pipe's size) for every pipe whose read end the task holds, the unread bytes following
// it; an empty pipe has bytes 0.
func setPipeData(im *image, id uint32, data []byte) {
	im.changed = true
	var pde *pipe_data.PipeDataEntry
	at := -1
	for i, e := range im.entries {
		if x := e.Message.(*pipe_data.PipeDataEntry); x.GetPipeId() == id {
			pde, at = x, i
			break
		}
	}
	if pde == nil {
		if len(data) == 0 {
			return
		}
		pde = &pipe_data.PipeDataEntry{PipeId: ptr(id)}
		im.entries = append(im.entries, &crit.CriuEntry{Message: pde})
		at = len(im.entries) - 1
	}
	if len(data) == 0 && pde.Size == nil {
		im.entries = append(im.entries[:at], im.entries[at+1:]...)
		return
	}
	pde.Bytes = ptr(uint32(len(data)))
	im.entries[at].Extra = base64.StdEncoding.EncodeToString(data)
	// The restore writes the bytes without blocking: the pipe must hold them.
	if size := pde.GetSize(); pde.Size == nil && len(data) > defaultPipeSize || pde.Size != nil && int(size) < len(data) {
		n := uint32(4096)
		for int(n) < len(data) {
			n <<= 1
		}
		pde.Size = &n
	}
}
