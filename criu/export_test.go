package criu

// StartWorkerWith and StartRestoreWorkerWith start workers running the program at
// path instead of CRIU.
var (
	StartWorkerWith        = startWorker
	StartRestoreWorkerWith = startRestoreWorker
)
