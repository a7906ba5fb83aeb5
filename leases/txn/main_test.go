package txn

import (
	"os"
	"testing"

	"github.com/leasehold/leasehold/internal/etcdtest"
)

func TestMain(m *testing.M) { os.Exit(etcdtest.Main(m)) }
