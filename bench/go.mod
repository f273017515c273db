module github.com/leasehold/leasehold/bench

go 1.26.8
