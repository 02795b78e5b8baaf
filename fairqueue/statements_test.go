package fairqueue

import (
	"fmt"
	"testing"
	"time"

	"github.com/sqllock/sqllock/internal/wait"
	"github.com/sqllock/sqllock/testdb"
)

// TestMySQLStatementsDrawNoWarnings: the server accepts every MySQL statement of
// the package without a warning (no deprecated syntax such as VALUES(col)).
func TestMySQLStatementsDrawNoWarnings(t *testing.T) {
	testdb.CheckMySQLStatements(t, map[string]string{
		"enqueueMySQL":       enqueueMySQL,
		"bumpMySQL":          bumpMySQL,
		"drawTxLockMySQL":    drawTxLockMySQL,
		"drawTxHighestMySQL": drawTxHighestMySQL,
		"drawTxTicketMySQL":  drawTxTicketMySQL,
		"createMySQL":        createMySQL,
		"predecessorsMySQL":  predecessorsMySQL,
		"dropDeadMySQL":      dropDeadMySQL,
		"renewMySQL":         renewMySQL,
		"releaseMySQL":       releaseMySQL,
		"forgetMySQL":        forgetMySQL,
		"checkMySQL":         checkMySQL,
		"sweepSelectMySQL":   sweepSelectMySQL,
		"sweepDeleteMySQL":   sweepDeleteMySQL,
		"lineLookMySQL": fmt.Sprintf(lineLookMySQLFmt, wait.MyTicketName("X'00'", "2"),
			wait.MyEnter(wait.MyTicketName("X'00'", "1"), time.Second), "X'00'", 2, wait.MyTicketName("X'00'", "1")),
		"releaseLineMySQL":      fmt.Sprintf(releaseLineMySQLFmt, "X'00'", 2, "X'01'", ""),
		"releaseLineAfterMySQL": fmt.Sprintf(releaseLineMySQLFmt, "X'00'", 2, "X'01'", fmt.Sprintf(higherLeftMySQLFmt, "X'00'")),
		"releaseAfterMySQL":     releaseAfterMySQL,
		"bumpOwnerMySQL":        bumpOwnerMySQL,
		"topRowMySQL":           topRowMySQL,
		"bumpLineMySQL":         fmt.Sprintf(bumpMySQLFmt, "2", "X'00'"),
		"enqueueLineMySQL": fmt.Sprintf(enqueueLineMySQLFmt, "X'00'", "X'01'", 1000, "X'02'", 1,
			wait.MyTicketName("X'00'", enqueueNumberMySQL)),
	})
}
