package sqllock

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Sentinel errors. Every error returned by this module that has one of these meanings
// matches it with errors.Is, whatever wraps it.
var (
	// ErrNotAcquired reports that the lock was not acquired: it is held by someone else
	// (TryAcquire), or the context of Acquire ended first. In the latter case the error
	// also matches the context's error (context.Canceled or context.DeadlineExceeded).
	ErrNotAcquired = errors.New("sqllock: lock not acquired")

	// ErrLost reports that a lease is no longer held: its session died, its keepalive
	// could not renew it in time, or its row was taken over or deleted. Work done under
	// the lease after the loss was not protected by it.
	ErrLost = errors.New("sqllock: lock lost")

	// ErrNotHeld reports an operation on a lease that was already released.
	ErrNotHeld = errors.New("sqllock: lock not held")

	// ErrInvalidName reports a lock name that breaks the name rules (see ValidateName).
	// It is returned before any SQL is sent.
	ErrInvalidName = errors.New("sqllock: invalid lock name")

	// ErrInvalidOption reports an option value that cannot be used, for example a TTL
	// shorter than twice the keepalive interval. Constructors return it.
	ErrInvalidOption = errors.New("sqllock: invalid option")

	// ErrNotMigrated reports that a table or column of the library is missing from the
	// database: apply the migrations (migrations.Up) first, including those added by
	// the library version you upgraded to.
	ErrNotMigrated = errors.New("sqllock: the library's tables are missing: run migrations.Up")

	// ErrUnsupported reports an operation the strategy cannot perform, for example
	// Leader on a strategy that records no holder (advisory, forupdate). It also
	// matches the standard library's errors.ErrUnsupported.
	ErrUnsupported = fmt.Errorf("sqllock: not supported by this strategy: %w", errors.ErrUnsupported)

	// ErrNoHolder reports that nobody holds the lock (Leader, HolderInspector.Holder).
	ErrNoHolder = errors.New("sqllock: lock has no holder")

	// ErrUnsafeDeployment reports that the strategy refuses the database it was given
	// because there it could not keep its promise: a Galera node for the server-local
	// locks (advisory, forupdate), a PostgreSQL primary with asynchronous standbys
	// under WithRequireSyncReplication, a transaction-pooling proxy under advisory's
	// session locks. The error names the reason. It also matches ErrInvalidOption:
	// the remedy is the deployment or an explicit option, not a retry.
	ErrUnsafeDeployment error = unsafeDeployment{}
)

type unsafeDeployment struct{}

func (unsafeDeployment) Error() string { return "sqllock: unsafe deployment for this strategy" }

// Is makes ErrUnsafeDeployment match ErrInvalidOption too.
func (unsafeDeployment) Is(target error) bool { return target == ErrInvalidOption }

// Error is the error type of this module. It records which operation failed, on which
// dialect and which lock name, and matches both its Kind (one of the sentinel errors,
// or nil) and its underlying cause with errors.Is and errors.As.
type Error struct {
	Op      string  // operation: "acquire", "try-acquire", "release", "keepalive", ...
	Dialect Dialect // database dialect, zero when unknown
	Name    string  // lock name, empty when not about one lock
	Kind    error   // sentinel error, or nil
	Err     error   // underlying cause, or nil
}

func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("sqllock: ")
	b.WriteString(e.Op)
	if e.Dialect != 0 {
		b.WriteString(" (")
		b.WriteString(e.Dialect.String())
		b.WriteString(")")
	}
	if e.Name != "" {
		b.WriteString(" ")
		b.WriteString(quoteName(e.Name))
	}
	if e.Kind != nil {
		b.WriteString(": ")
		b.WriteString(strings.TrimPrefix(e.Kind.Error(), "sqllock: "))
	}
	if e.Err != nil {
		b.WriteString(": ")
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

// Unwrap returns the Kind and the cause, so that errors.Is matches either.
func (e *Error) Unwrap() []error {
	errs := make([]error, 0, 2)
	if e.Kind != nil {
		errs = append(errs, e.Kind)
	}
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	return errs
}

// quoteName quotes a lock name for messages, eliding the middle of very long names.
func quoteName(name string) string {
	const max = 80
	if len(name) > max {
		name = name[:max/2] + "..." + name[len(name)-max/2:]
	}
	return strconv.Quote(name)
}
