package criu

// StartWorkerWith starts a worker running the program at path instead of CRIU.
var StartWorkerWith = startWorker
