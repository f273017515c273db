module github.com/leasehold/leasehold/tools/doclinks

go 1.26.8
