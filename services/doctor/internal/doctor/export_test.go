package doctor

// ClassifyVersion exposes classifyVersion to the external tests.
var ClassifyVersion = classifyVersion
