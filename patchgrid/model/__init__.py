"""The model: its families and sites (where each site lives in each family), the model folders
(the default and the seeded test models), and which tensor-parallel rank holds which head."""
