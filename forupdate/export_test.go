package forupdate

// WaitState reports, for tests, how many Lock calls of l hold a waiter slot, how many
// wait in the process for one (after their NOWAIT attempt), and how many statements
// that may wait for a lock are under way.
func (l *Locker) WaitState() (slots, queued, inDB int) {
	return len(l.waiters), int(l.queued.Load()), int(l.inDB.Load())
}
