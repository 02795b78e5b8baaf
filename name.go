package sqllock

import "fmt"

// MaxNameLen is the longest lock name, in bytes, that every strategy accepts.
const MaxNameLen = 4096

// ValidateName checks a lock name against the rules every strategy follows, and
// returns an error matching ErrInvalidName if it breaks them:
//
//   - a name is a sequence of 1 to MaxNameLen bytes, compared byte for byte: 'Job' and
//     'job' are different locks, and so are 'a' and 'a ';
//   - any byte is allowed, including NUL and bytes that are not valid UTF-8;
//   - a name is never truncated or folded: strategies whose server has a shorter limit
//     (GET_LOCK, advisory keys) map it to a fixed-size key with a cryptographic hash.
//
// Strategies call it before they send any SQL.
func ValidateName(name string) error {
	switch {
	case name == "":
		return &Error{Op: "validate-name", Kind: ErrInvalidName, Err: fmt.Errorf("empty name")}
	case len(name) > MaxNameLen:
		return &Error{Op: "validate-name", Name: name, Kind: ErrInvalidName,
			Err: fmt.Errorf("name is %d bytes, longer than %d", len(name), MaxNameLen)}
	}
	return nil
}
