package main

import (
	"testing"

	"github.com/leasehold/leasehold/pkg/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }
