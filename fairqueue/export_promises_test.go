package fairqueue

import "time"

// SetNow replaces the client clock of l (time.Now by default), for the tests that
// shift it. Call it before l's first acquisition.
func SetNow(l *Locker, now func() time.Time) { l.b.Now = now }
