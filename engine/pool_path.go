package engine

// PoolPath returns the host path of a pool volume (a template's Volume, a sandbox's
// Root, a checkpoint's FSVolume), or the pool's root directory for "". It returns ""
// for a name that is not a valid volume name.
func (e *Engine) PoolPath(volume string) string {
	if volume == "" {
		return e.btrfs.Root()
	}
	return e.pool.Path(volume)
}

// ImagePoolPath returns the mount point of the image pool (Config.ImagePool), "" when
// new checkpoints' images are not on one.
func (e *Engine) ImagePoolPath() string {
	if e.imgPool == nil {
		return ""
	}
	return e.imgPool.Root()
}
